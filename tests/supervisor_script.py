"""A supervising process for tests/test_launch.py and tests/test_warm.py, which SIGKILL it.

Run as ``python -m tests.supervisor_script START_METHOD BACKEND`` from the
repository root; START_METHOD ``warm`` is ``spawn`` with ``preload=["json"]``
(ranks forked from a warm-start template). It starts a group of two ranks,
waits until both run, prints their pids as one JSON line, then waits for a
line on stdin (or its end) and shuts the group down. The test kills it
before that, and checks that the ranks die with it.
"""

from __future__ import annotations

import json
import multiprocessing
import sys

import anyio

import aiospawn
from tests import ranks

NPROCS = 2


async def supervise(start_method: str) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            ranks.launch_report_ready,
            (writer,),
            nprocs=NPROCS,
            join=False,
            start_method="spawn" if start_method == "warm" else start_method,
            preload=["json"] if start_method == "warm" else None,
            grace_period=1,
        )
        try:
            for _ in range(NPROCS):
                await anyio.to_thread.run_sync(reader.recv)
            print(json.dumps({"pids": ctx.pids()}), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
        finally:
            await ctx.terminate()


if __name__ == "__main__":
    anyio.run(supervise, sys.argv[1], backend=sys.argv[2])
