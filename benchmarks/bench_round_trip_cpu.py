"""Where a round trip's time goes: the supervisor's CPU and the ranks' CPU, per request.

Issue 26's latency targets compare aiospawn with a socket pair driven from the
same event loop. This splits each request of ``bench_small_messages``' cases
(64 B to one rank and to 8 ranks, 1 MB to one rank: a message and its answer,
or a call) into what each end spent, for the asyncio floor (a blocking peer
per socket pair), aiospawn's channel and ``ctx.call()``:

* the wall time per request (mean, over ``--count`` requests);
* the event-loop thread's CPU per request (``time.thread_time()``);
* the ranks' CPU per request: every descendant process of this one, read
  from ``/proc`` before and after (the other transports' ranks sleep in a
  read meanwhile, and count nothing).

The transports are ``bench_dataplane``'s, all open at once; trials alternate
(a different peer first in each round), and each line gives the median of
the trials with the load average at the case's start. Like the scenario, it
holds glibc's malloc steady (``harness.STEADY_MALLOC``)::

    PYTHONPATH=src python benchmarks/bench_round_trip_cpu.py --trials 5
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing.forkserver
import os
import statistics
import time
from typing import Any

import anyio
import bench_dataplane as dataplane
from harness import hold_malloc_steady

import aiospawn

#: The cases: name, the ranks asked, the payload's size, and the requests per trial (a share
#: of ``--count``).
CASES = (
    ("64 B round trip, 1 rank", [0], 64, 1.0),
    (f"64 B round trip, {dataplane.NPROCS} ranks", list(range(dataplane.NPROCS)), 64, 1.0),
    ("1 MB round trip, 1 rank", [0], 1_000_000, 0.1),
)
TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children of its threads, recursively), from ``/proc``."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        with contextlib.suppress(FileNotFoundError):
            for task in os.listdir(f"/proc/{parent}/task"):
                path = f"/proc/{parent}/task/{task}/children"
                with contextlib.suppress(FileNotFoundError), open(path) as children:
                    for child in children.read().split():
                        found.append(int(child))
                        pending.append(int(child))
    return found


def cpu_of(pids: list[int]) -> float:
    """The CPU seconds (user and system) the processes ``pids`` have spent so far."""
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


async def trial(transport: Any, ranks: list[int], size: int, count: int) -> dict[str, float]:
    """``count`` requests of ``size`` bytes; per request: wall, loop and ranks' CPU [µs]."""
    payload = dataplane.make_payload("bytes", size)
    pids = descendants(os.getpid())
    for _ in range(20):  # warm
        await transport.request("echo", payload, ranks)
    ranks_before, loop_before, began = cpu_of(pids), time.thread_time(), time.perf_counter()
    for _ in range(count):
        await transport.request("echo", payload, ranks)
    wall = time.perf_counter() - began
    loop, ranks_cpu = time.thread_time() - loop_before, cpu_of(pids) - ranks_before
    return {
        "wall": wall / count * 1e6,
        "loop CPU": loop / count * 1e6,
        "ranks' CPU": ranks_cpu / count * 1e6,
    }


async def main(trials: int, count: int) -> None:
    multiprocessing.forkserver.set_forkserver_preload(["numpy", "dataplane_ranks"])
    print(f"aiospawn from {os.path.dirname(aiospawn.__file__)}", flush=True)
    async with contextlib.AsyncExitStack() as stack:
        transports = []
        for kind in (dataplane.SocketAsyncio, dataplane.AiospawnChannel, dataplane.AiospawnCall):
            transport = kind()
            await transport.open(stack, "")
            transports.append(transport)
        for name, ranks, size, share in CASES:
            requests = max(1, round(count * share))
            load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
            rows: dict[str, list[dict[str, float]]] = {t.name: [] for t in transports}
            for index in range(trials):
                shift = index % len(transports)
                for transport in transports[shift:] + transports[:shift]:
                    rows[transport.name].append(await trial(transport, ranks, size, requests))
            print(f"\n{name} ({requests} requests a trial, {trials} trials, load {load})")
            print(f"  {'':30s} {'wall':>8s} {'loop CPU':>9s} {'ranks CPU':>9s}  [µs per request]")
            for peer, results in rows.items():
                cells = [statistics.median(r[key] for r in results) for key in results[0]]
                print(f"  {peer:30s} {cells[0]:8.1f} {cells[1]:9.1f} {cells[2]:9.1f}")
    print(f"\nload after: {', '.join(f'{value:.2f}' for value in os.getloadavg())}")


if __name__ == "__main__":
    hold_malloc_steady()  # as the dataplane scenario's is
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per peer and case")
    parser.add_argument("--count", type=int, default=3000, help="requests per trial")
    arguments = parser.parse_args()
    anyio.run(main, arguments.trials, arguments.count)
