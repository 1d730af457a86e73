"""Forkserver ranks find the rank bootstrap imported by the fork server, not by themselves."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent(
    """
    import json, multiprocessing, multiprocessing.forkserver, sys
    import anyio, aiospawn
    from tests import ranks

    async def main():
        multiprocessing.set_forkserver_preload(["__main__", "json"])
        results = await aiospawn.start_processes(
            ranks.api_return_rank, nprocs=2, start_method="forkserver"
        )
        preload = multiprocessing.forkserver._forkserver._preload_modules
        print(json.dumps({"results": results, "preload": preload}))

    anyio.run(main)
    """
)


def test_the_fork_server_preloads_the_bootstrap_and_keeps_the_users_list() -> None:
    # A fresh supervisor: the test process's own fork server already runs.
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    shown = json.loads(completed.stdout)
    assert shown["results"] == [0, 1]
    assert shown["preload"] == ["__main__", "json", "aiospawn._rank.bootstrap"]
