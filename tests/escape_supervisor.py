"""A supervisor for the escape tests, run as a script: ``python escape_supervisor.py HOW METHOD``.

Starts one rank (``escape_ranks.escape_then_wait``) that leaves an escapee
behind (``HOW``: group, session or daemon), prints one JSON line with the
supervisor's, the rank's and the escapee's pids, then waits for the group for
ever: tests/test_escapes.py SIGKILLs this process and checks that both die.

The module body only defines things: spawn and forkserver ranks import it again.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

import aiospawn
from tests import escape_ranks


async def main(how: str, start_method: str) -> None:
    reader, writer = multiprocessing.get_context(start_method).Pipe(duplex=False)
    async with aiospawn.open_group(
        escape_ranks.escape_then_wait, (how, writer), nprocs=1, start_method=start_method
    ):
        await anyio.wait_readable(reader.fileno())
        rank, escapee = reader.recv()
        print(json.dumps({"supervisor": os.getpid(), "rank": rank, "escapee": escapee}), flush=True)
        await anyio.sleep_forever()  # only our death ends this


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
