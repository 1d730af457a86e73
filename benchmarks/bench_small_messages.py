"""The dataplane scenario's small cases alone: the asyncio floor, aiospawn's channel and calls.

Issue 26's latency targets, each against a socket pair driven from the same
event loop (``bench_dataplane``'s "asyncio streams" floor): a 64 B round trip
(1 rank), a call to 1 rank and to 8 ranks, a 1 MB round trip. It runs
``bench_dataplane``'s own transports and cases, so its figures match that
scenario's rows, without the 100 MB cases and the other peers (a minute or two
instead of fifteen). To compare two checkouts, run it once with each on
``PYTHONPATH`` (``<checkout>/src``), alternately::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_small_messages.py --trials 5

Prints each case's medians (µs or ms) across trials, the fastest trial, and
the ratio to the floor's median, with the load average at each case's start.
Like the scenario, it holds glibc's malloc steady (``harness.STEADY_MALLOC``):
it runs itself again with those variables unless they are set.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing.forkserver
import os

import anyio
import bench_dataplane as dataplane
from harness import Peer, ScenarioResult, alternate, hold_malloc_steady

import aiospawn

#: The cases run, with their requests per trial.
COUNTS = {
    "64 B round trip, 1 rank": 1000,
    f"64 B round trip, {dataplane.NPROCS} ranks": 300,
    "1 MB round trip, 1 rank": 100,
}


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


async def main(trials: int) -> None:
    multiprocessing.forkserver.set_forkserver_preload(["numpy", "dataplane_ranks"])
    result = ScenarioResult(name="small", title="small messages")
    print(f"aiospawn from {os.path.dirname(aiospawn.__file__)}; load {_load()}", flush=True)
    async with contextlib.AsyncExitStack() as stack:
        running = []
        for kind in (dataplane.SocketAsyncio, dataplane.AiospawnChannel, dataplane.AiospawnCall):
            transport = kind()
            await transport.open(stack, "")
            running.append(transport)
        for case in dataplane.cases(quick=False):
            if case.name not in COUNTS:
                continue
            case = dataclasses.replace(case, count=COUNTS[case.name])
            payload = dataplane.make_payload(case.kind, case.size)
            peers = [
                Peer(transport.name, dataplane._runner(transport, case, payload), trials, 1)
                for transport in running
            ]
            load = _load()
            await alternate(result, case.name, peers, rotate=True)
            print(f"\n{case.name} (load at the start {load})", flush=True)
            series = [item for item in result.series if item.case == case.name]
            floor = {
                item.metric: item.median for item in series if item.peer == dataplane.FLOOR_ASYNCIO
            }
            for item in series:
                print(
                    f"  {item.peer:30s} {item.metric:9s} median {item.median:9.1f}"
                    f"  fastest {min(item.samples):9.1f}  {item.median / floor[item.metric]:.2f}x",
                    flush=True,
                )
    print(f"load after: {_load()}")


if __name__ == "__main__":
    hold_malloc_steady()  # as the dataplane scenario's is
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per peer and case")
    anyio.run(main, parser.parse_args().trials)
