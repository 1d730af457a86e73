"""Scenario ``small_parent``: a trivial group's cost in a fresh ``python -c`` supervisor.

The ``startup`` scenario measures a long-running harness whose parent has
imported torch and whose event loop, thread pools and fork server are warm;
that hides part of what a small program pays. Here each trial is a fresh
interpreter running ``python -c PROGRAM`` (the program is below), which starts
8 ranks that return a value and waits for the values, :data:`GROUPS` times
over:

* "first group": the first call in the process, so it includes what the call
  imports (aiospawn's supervisor modules; ``import aiospawn`` itself only
  loads the facade), anyio's worker threads and, under ``forkserver``, the
  fork server's start;
* "later group": the second call, in the same process;
* "groups 11-20": the median of the 11th to the 20th call, what a
  long-lived supervisor (a service that restarts its ranks) pays.

Peers, the same program but for the group itself:

* ``aiospawn``: ``await aiospawn.start_processes(workloads.return_rank,
  nprocs=8, start_method=m)`` inside ``anyio.run`` (asyncio unless the run
  says ``--backend trio``); ``import anyio, aiospawn`` come before the clock;
* ``multiprocessing``: 8 ``Process`` objects, each with a one-way ``Pipe``
  for its value (``workloads.send_rank``), started one after the other, the
  values received, each joined; ``import multiprocessing`` comes before the clock.
* ``multiprocessing, async parent``: the same group, in a parent shaped like
  aiospawn's: ``import anyio, aiospawn`` first, and the groups run inside
  ``anyio.run`` (blocking the loop, which has nothing else to do). Not a
  target: it tells what the parent's event loop costs, apart from our code.

The clock is ``time.perf_counter()`` in the small parent, from just before the
call (or the first ``Process``) to the values in hand and every rank reaped.
Targets (checked in ``report.py``): a later group within 1.2x of
``multiprocessing`` under each start method, the first group within 1.5x.
"""

from __future__ import annotations

import asyncio
import os
from functools import partial

from harness import Measure, Peer, ScenarioResult, alternate, run_trial

NPROCS = 8
START_METHODS = ("spawn", "forkserver", "fork")
#: Groups each small parent starts, one after the other.
GROUPS = 20

#: The small parent. argv: peer, start method, number of ranks, anyio backend, groups.
PROGRAM = """
import json, statistics, sys, time
import workloads
peer, method, nprocs, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
count = int(sys.argv[5])
times = []
if peer == "aiospawn":
    import anyio, aiospawn

    async def main():
        for _ in range(count):
            began = time.perf_counter()
            values = await aiospawn.start_processes(
                workloads.return_rank, nprocs=nprocs, start_method=method
            )
            times.append(time.perf_counter() - began)
            assert values == list(range(nprocs)), values

    anyio.run(main, backend=backend)
else:
    import multiprocessing  # before the first group's time, as for the aiospawn peer's import

    def groups():
        for _ in range(count):
            group()

    def group():
        began = time.perf_counter()
        values = workloads.plain_group(method, nprocs)
        times.append(time.perf_counter() - began)
        assert values == list(range(nprocs)), values

    if peer == "multiprocessing-async":
        import anyio, aiospawn

        async def main():
            groups()

        anyio.run(main, backend=backend)
    else:
        groups()
print(json.dumps([times[0] * 1000, times[1] * 1000, statistics.median(times[10:20]) * 1000]))
"""


def _small_parent(peer: str, method: str, backend: str) -> Measure:
    # Blocking, on the loop's thread: nothing else runs in this worker meanwhile.
    first, later, long_lived = run_trial(
        PROGRAM, peer, method, str(NPROCS), backend, str(GROUPS), timeout=300
    )
    return {
        "first group [ms]": first,
        "later group [ms]": later,
        "groups 11-20 [ms]": long_lived,
    }


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
        f" value, {GROUPS} times: 'first group' is the first call in the process (what it"
        " imports, the worker threads, under forkserver the fork server's start), 'later"
        " group' the second, 'groups 11-20' the median of the 11th to the 20th (a long-lived"
        " supervisor)."
        " aiospawn: `await aiospawn.start_processes(fn, nprocs=8, start_method=m)` in"
        f" `anyio.run` ({backend}); multiprocessing: 8 `Process` with a one-way `Pipe` each,"
        " started one after the other, values received, joined; 'multiprocessing, async parent':"
        " the same, inside `anyio.run` after `import anyio, aiospawn` (what the parent alone"
        " costs; not a target). Imports of anyio, aiospawn (its facade) and multiprocessing"
        " come before the clock."
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
                Peer(
                    "multiprocessing, async parent",
                    partial(_small_parent, "multiprocessing-async", method, backend),
                    trials,
                ),
            ],
        )
