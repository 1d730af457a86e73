"""A supervising process with warm ranks, for tests/test_warm.py, which SIGKILLs it.

Run as ``python -m tests.warm_supervisor BACKEND`` from the repository root. It
starts two warm ranks (preloading ``json``), waits until both run, prints
their pids as one JSON line, then waits for a line on
stdin (or its end) and shuts the group down. The test kills it before that.
"""

from __future__ import annotations

import json
import multiprocessing
import sys

import anyio

import aiospawn
from tests import ranks

NPROCS = 2


async def supervise() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            ranks.launch_report_ready,
            (writer,),
            nprocs=NPROCS,
            join=False,
            preload=["json"],
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
    anyio.run(supervise, backend=sys.argv[1])
