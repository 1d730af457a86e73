"""Scenario ``small_parent``: a trivial group's cost in a fresh ``python -c`` supervisor.

The ``startup`` scenario measures a long-running harness whose parent has
imported torch and whose event loop, thread pools and fork server are warm;
that hides part of what a small program pays. Here each trial is a fresh
interpreter running ``python -c PROGRAM`` (the program is below), which starts
8 ranks that return a value, waits for the values, then does the same again:

* "first group": the first call in the process, so it includes what the call
  imports (aiospawn's supervisor modules; ``import aiospawn`` itself only
  loads the facade), anyio's worker threads and, under ``forkserver``, the
  fork server's start;
* "later group": the second call, in the same process.

Peers, the same program but for the group itself:

* ``aiospawn``: ``await aiospawn.start_processes(workloads.return_rank,
  nprocs=8, start_method=m)`` inside ``anyio.run`` (asyncio unless the run
  says ``--backend trio``); ``import anyio, aiospawn`` come before the clock;
* ``multiprocessing``: 8 ``Process`` objects, each with a one-way ``Pipe``
  for its value (``workloads.send_rank``), started one after the other, the
  values received, each joined; ``import multiprocessing`` comes before the clock.

The clock is ``time.perf_counter()`` in the small parent, from just before the
call (or the first ``Process``) to the values in hand and every rank reaped.
Targets (checked in ``report.py``): a later group within 1.2x of
multiprocessing under each start method, the first group within 1.5x.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from functools import partial

from harness import Measure, Peer, ScenarioResult, alternate

NPROCS = 8
START_METHODS = ("spawn", "forkserver", "fork")

#: The small parent. argv: peer, start method, number of ranks, anyio backend.
PROGRAM = """
import sys, time
import workloads
peer, method, nprocs, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
times = []
if peer == "aiospawn":
    import anyio, aiospawn

    async def main():
        for _ in range(2):
            began = time.perf_counter()
            values = await aiospawn.start_processes(
                workloads.return_rank, nprocs=nprocs, start_method=method
            )
            times.append(time.perf_counter() - began)
            assert values == list(range(nprocs)), values

    anyio.run(main, backend=backend)
else:
    import multiprocessing

    context = multiprocessing.get_context(method)
    for _ in range(2):
        began = time.perf_counter()
        pipes = [context.Pipe(duplex=False) for _ in range(nprocs)]
        processes = [
            context.Process(target=workloads.send_rank, args=(rank, writer))
            for rank, (_, writer) in enumerate(pipes)
        ]
        for process in processes:
            process.start()
        for _, writer in pipes:
            writer.close()
        values = [reader.recv() for reader, _ in pipes]
        for process in processes:
            process.join()
        for reader, _ in pipes:
            reader.close()
        times.append(time.perf_counter() - began)
        assert values == list(range(nprocs)), values
print(times[0] * 1000, times[1] * 1000)
"""


def _small_parent(peer: str, method: str, backend: str) -> Measure:
    # Blocking, on the loop's thread: nothing else runs in this worker meanwhile.
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM, peer, method, str(NPROCS), backend],
        cwd=here,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the small parent ({peer}, {method}) failed:\n{completed.stderr}")
    first, later = (float(word) for word in completed.stdout.split())
    return {"first group [ms]": first, "later group [ms]": later}


def _backend() -> str:
    """The event loop this worker runs on, which the small parents use too."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        return "trio"
    return "asyncio"


async def small_parent(result: ScenarioResult, quick: bool) -> None:
    """8 trivial ranks from a fresh ``python -c`` supervisor: its first group and a later one."""
    backend = _backend()
    trials = 5 if quick else 21
    result.note(
        f"Each trial is a fresh `python -c` supervisor that starts {NPROCS} ranks returning a"
        " value, twice: 'first group' is the first call in the process (what it imports, the"
        " worker threads, under forkserver the fork server's start), 'later group' the second."
        " aiospawn: `await aiospawn.start_processes(fn, nprocs=8, start_method=m)` in"
        f" `anyio.run` ({backend}); multiprocessing: 8 `Process` with a one-way `Pipe` each,"
        " started one after the other, values received, joined. Imports of anyio, aiospawn"
        " (its facade) and multiprocessing come before the clock."
    )
    for method in START_METHODS:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
        result.note(f"{method}: load average (1, 5, 15 min) at the case's start: {load}.")
        await alternate(
            result,
            f"{method}, N={NPROCS}",
            [
                Peer("aiospawn", partial(_small_parent, "aiospawn", method, backend), trials),
                Peer(
                    "multiprocessing",
                    partial(_small_parent, "multiprocessing", method, backend),
                    trials,
                ),
            ],
        )
