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
import os
from pathlib import Path

import anyio
import pytest

import aiospawn
import aiospawn.sync
from tests import ddp_ranks
from tests.cli_helpers import environ, program, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="the DDP job needs torch (pip install torch==2.13.0)",
    ),
]

#: Runs of the job per way in (``AIOSPAWN_STRESS`` scales it): four, twelve
#: jobs in all, each two ranks that import torch (about 5 s of CPU a job).
RUNS = max(1, int(4 * float(os.environ.get("AIOSPAWN_STRESS", "1"))))


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # pytest makes its base temp dir on first use, inside our temp dir; made
    # before the leak check's baseline, it is not a leak of the first test.
    tmp_path_factory.getbasetemp()


@pytest.fixture(autouse=True)
def _rank_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch leaves its compiler's cache dir in a rank's temp dir: one of the test's own.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))


# A run takes 10-25 s on two busy cores.
@pytest.mark.timeout(900)
def test_ddp_job_under_aiospawn_spawn_finishes_every_run() -> None:
    async def job() -> list[float]:
        address = ddp_ranks.free_address()
        return await aiospawn.spawn(ddp_ranks.train, args=(2, address), nprocs=2)

    for attempt in range(RUNS):
        checksums = anyio.run(job)
        assert checksums[0] == checksums[1], f"run {attempt}"  # DDP kept the weights equal


@pytest.mark.timeout(900)
def test_ddp_job_under_aiospawn_sync_spawn_finishes_every_run() -> None:
    for _ in range(RUNS):
        aiospawn.sync.spawn(ddp_ranks.train, args=(2, ddp_ranks.free_address()), nprocs=2)


@pytest.mark.timeout(900)
def test_ddp_job_under_aiospawn_run_finishes_every_run() -> None:
    env = environ()  # TMPDIR is the test's own (see _rank_temp_dir)
    for attempt in range(RUNS):
        result = run("run", "-n", "2", program("ddp_job.py"), env=env)
        assert result.returncode == 0, f"run {attempt}: {result.stderr}"
        assert result.stdout.count("checksum ") == 2, f"run {attempt}: {result.stdout}"
