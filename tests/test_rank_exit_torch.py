"""A real DDP job (torch, gloo on CPU, two ranks) reads as finished, run after run.

Under ``spawn``, such a job used to die of SIGABRT in some runs after every
rank's ``fn`` had returned: torch's C++ static destructors aborted in the
interpreter's finalization. Ranks now end with ``os._exit`` after Python's
exit steps (see ``test_rank_exit`` for the mechanism, without torch). Each
way in is run :data:`RUNS` times in a row: the library's ``spawn``, the
drop-in ``aiospawn.sync.spawn`` and ``aiospawn run -n 2``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anyio
import pytest

import aiospawn
import aiospawn.sync
from tests import ddp_ranks
from tests.cli_helpers import environ, program, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="the DDP job needs torch (pip install torch==2.13.0)",
    ),
]

#: Runs of the job per way in: with the old ending, 10 spawn runs all
#: finishing had a chance of a few percent.
RUNS = 10


def test_ddp_job_under_aiospawn_spawn_finishes_every_run() -> None:
    async def job() -> list[float]:
        address = ddp_ranks.free_address()
        return await aiospawn.spawn(ddp_ranks.train, args=(2, address), nprocs=2)

    for attempt in range(RUNS):
        checksums = anyio.run(job)
        assert checksums[0] == checksums[1], f"run {attempt}"  # DDP kept the weights equal


def test_ddp_job_under_aiospawn_sync_spawn_finishes_every_run() -> None:
    for _ in range(RUNS):
        aiospawn.sync.spawn(ddp_ranks.train, args=(2, ddp_ranks.free_address()), nprocs=2)


def test_ddp_job_under_aiospawn_run_finishes_every_run(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    env = environ(TMPDIR=str(tmp_path / "tmp"))
    for attempt in range(RUNS):
        result = run("run", "-n", "2", program("ddp_job.py"), env=env)
        assert result.returncode == 0, f"run {attempt}: {result.stderr}"
        assert result.stdout.count("checksum ") == 2, f"run {attempt}: {result.stdout}"
