"""Forkserver ranks find the rank bootstrap imported by the fork server, not by themselves.

The server also freezes its heap once it has imported it, so that a rank's
collections leave the server's objects (and their pages) alone; the
supervisor itself never freezes anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent(
    """
    import gc, json, multiprocessing, multiprocessing.forkserver, sys
    import anyio, aiospawn
    from tests import ranks

    # What the interpreter froze itself (375 objects on 3.12.1, none on 3.11).
    frozen_at_start = gc.get_freeze_count()

    async def main():
        multiprocessing.set_forkserver_preload(["__main__", "json"])
        results = await aiospawn.start_processes(
            ranks.api_return_rank, nprocs=2, start_method="forkserver"
        )
        frozen = await aiospawn.start_processes(
            ranks.api_frozen_objects, nprocs=2, start_method="forkserver"
        )
        preload = multiprocessing.forkserver._forkserver._preload_modules
        print(json.dumps({
            "results": results,
            "preload": preload,
            "frozen in ranks": frozen,
            "frozen at start": frozen_at_start,
            "frozen here": gc.get_freeze_count(),
        }))

    anyio.run(main)
    """
)


def run_supervisor(program: str) -> Any:
    """Run ``program`` as a fresh supervisor (the test process's own fork server
    already runs); return what it printed, as JSON."""
    completed = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_the_fork_server_preloads_the_bootstrap_freezes_and_keeps_the_users_list() -> None:
    shown = run_supervisor(PROGRAM)
    assert shown["results"] == [0, 1]
    assert shown["preload"] == ["__main__", "json", "aiospawn._rank.forkserver"]
    # The server's objects (the bootstrap and json among them, thousands) are frozen.
    assert all(count > shown["frozen at start"] + 1000 for count in shown["frozen in ranks"]), shown
    assert shown["frozen here"] == shown["frozen at start"]


RESTART_PROGRAM = textwrap.dedent(
    """
    import json, os, signal, time
    import anyio, aiospawn
    from aiospawn._local import _forkserver
    from tests import ranks
    from tests.helpers import is_gone

    early_starts = []
    start_early = _forkserver.start_early

    def counted_start_early():
        early_starts.append(os.getpid())
        start_early()

    _forkserver.start_early = counted_start_early

    async def group():
        return await aiospawn.start_processes(
            ranks.api_fork_server, nprocs=2, start_method="forkserver"
        )

    async def main():
        first = await group()
        second = await group()
        os.kill(first[0][0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not is_gone(first[0][0]) and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        third = await group()
        print(json.dumps({"groups": [first, second, third], "early starts": len(early_starts)}))

    anyio.run(main)
    """
)


def test_a_fork_server_that_died_between_groups_is_started_again_with_the_bootstrap() -> None:
    # Only the first forkserver call starts the server itself; a later one
    # relies on multiprocessing starting it again, from the same preload list.
    shown = run_supervisor(RESTART_PROGRAM)
    assert shown["early starts"] == 1
    first, second, third = shown["groups"]
    servers = [{server for server, _ in group} for group in (first, second, third)]
    assert len(servers[0]) == 1  # one server, kept
    assert servers[1] == servers[0]
    assert len(servers[2]) == 1  # a new one
    assert servers[2] != servers[0]
    assert all(preloaded for group in (first, second, third) for _, preloaded in group)


def test_a_forkserver_rank_whose_fn_the_server_preloaded_imports_nothing() -> None:
    # The descriptors a rank is given (its result pipe, its channel) are
    # pickled as multiprocessing.popen_forkserver objects: the server imports
    # that module before it forks, so unpickling them imports nothing.
    program = textwrap.dedent(
        """
        import json, multiprocessing
        import anyio, aiospawn

        async def main():
            # The spy, preloaded before the bootstrap, sees every import in a rank.
            multiprocessing.set_forkserver_preload(["tests.import_spy"])
            from tests import import_spy
            print(json.dumps(await aiospawn.start_processes(
                import_spy.imported_in_rank, nprocs=2, start_method="forkserver"
            )))

        anyio.run(main)
        """
    )
    assert run_supervisor(program) == [[], []]
