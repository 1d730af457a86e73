"""Real clients of torch.multiprocessing, run through the one-line swap to aiospawn.sync.

Each client runs on CPU with gloo, two ranks, its own code unchanged but for
``torch.multiprocessing`` (as the client module names it) replaced by
``aiospawn.sync``. A plain DDP job runs in this process; lightning and
accelerate run in a process of their own (``python -m tests.client_ranks``),
whose imports, warnings and files stay out of the test worker. Each test is
skipped when its client is not installed (``pip install -e '.[clients]'``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import aiospawn.sync
from tests import client_ranks
from tests.cli_helpers import REPO, basetemp_first, environ
from tests.ddp_ranks import free_address
from tests.helpers import is_gone

pytestmark = [
    pytest.mark.torch,
    # Beyond the client's own tripwire (client()): each client program starts
    # two to four groups, whose ranks import torch, which takes minutes on a
    # loaded machine.
    pytest.mark.timeout(360),
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="the real clients need torch (pip install torch==2.13.0)",
    ),
]

__all__ = ["basetemp_first"]  # the fixture: pytest's base temp dir before the leak check's baseline


def needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None,
        reason=f"{package} is not installed (pip install -e '.[clients]')",
    )


@pytest.fixture(autouse=True)
def _temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch leaves its compiler's cache dir in a rank's temp dir: one of the test's own.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))


def rank_pids(directory: Path) -> list[int]:
    """The pids the ranks left, after checking that aiospawn started each (it leads its group)."""
    notes = [path.read_text().split() for path in sorted(directory.glob("rank*.pid"))]
    assert len(notes) == 2, f"ranks that started: {notes}"
    assert all(leads == "1" for _, leads in notes), "a rank was not started by aiospawn"
    return [int(pid) for pid, _ in notes]


def client(module: str, *args: str, cwd: Path) -> dict[str, Any]:
    """Run ``python -m tests.MODULE ARGS`` in ``cwd``; return its ``RESULT`` line's fields."""
    env = environ(PYTHONPATH=str(REPO), TMPDIR=str(cwd / "tmp"))
    result = subprocess.run(
        [sys.executable, "-m", f"tests.{module}", *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,  # a deadlock tripwire: a run takes 10-30 s
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, result.stdout
    fields: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    return fields


def rank_raised(directory: Path) -> dict[str, Any]:
    """What a client's caller gets when rank :data:`~client_ranks.FAILING_RANK` raises.

    aiospawn's ``ProcessRaisedException``, also caught as torch's, naming that
    rank and the pid it had, with the rank's own ``ValueError`` as its cause
    (the fields of ``client_ranks.describe``). And no rank is left.
    """
    pids = rank_pids(directory)
    assert all(is_gone(pid) for pid in pids)
    return {
        "error": "ProcessRaisedException",
        "aiospawn": True,
        "torch": True,
        "index": client_ranks.FAILING_RANK,
        "pid": pids[client_ranks.FAILING_RANK],
        "cause": repr(ValueError(client_ranks.FAILURE)),
    }


def weights(directory: Path) -> list[dict[str, bytes]]:
    """Each rank's saved weights, as the bytes of each tensor."""
    import torch

    return [
        {name: t.numpy().tobytes() for name, t in torch.load(path).items()}
        for path in sorted(directory.glob("rank*.pt"))
    ]


# A DDP job ------------------------------------------------------------------


def test_ddp_job_weights_are_bit_identical_to_torch_spawn(tmp_path: Path) -> None:
    import torch.multiprocessing

    runs = {}
    for name, spawn in [("torch", torch.multiprocessing.spawn), ("aiospawn", aiospawn.sync.spawn)]:
        out = tmp_path / name
        out.mkdir()
        spawn(client_ranks.ddp_weights, args=(2, free_address(), str(out)), nprocs=2)
        runs[name] = weights(out)
        assert len(runs[name]) == 2, name
        assert runs[name][0] == runs[name][1], f"{name}: DDP kept the ranks' weights equal"
    assert runs["aiospawn"] == runs["torch"]


def test_ddp_job_with_a_failing_rank_reports_it_and_leaves_no_rank(tmp_path: Path) -> None:
    with pytest.raises(aiospawn.sync.ProcessRaisedException) as caught:
        aiospawn.sync.spawn(
            client_ranks.ddp_weights, args=(2, free_address(), str(tmp_path), True), nprocs=2
        )
    assert caught.value.error_index == client_ranks.FAILING_RANK
    assert repr(caught.value.__cause__) == repr(ValueError(client_ranks.FAILURE))
    assert client_ranks.FAILURE in caught.value.msg
    assert all(is_gone(pid) for pid in rank_pids(tmp_path))
    assert not list(tmp_path.glob("rank*.pt"))  # no rank finished


# lightning ------------------------------------------------------------------


@needs("lightning")
def test_lightning_fabric_ddp_spawn_launches_and_reports_a_failing_rank(tmp_path: Path) -> None:
    result = client("lightning_client", "fabric", str(tmp_path), cwd=tmp_path)
    first, second = result["ok"]  # every rank's final weights, as rank 0 gathered them
    assert first == second
    assert all(is_gone(pid) for pid in rank_pids(tmp_path / "ok"))
    # Rank 1 raised: its error reached the caller of launch(), and no rank is left.
    assert result["fail"] == rank_raised(tmp_path / "fail")
    # None was left running when launch() returned, or raised.
    assert (result["ok_left"], result["fail_left"]) == ([], [])


@needs("lightning")
def test_lightning_trainer_ddp_spawn_fits_and_reports_a_failing_rank(tmp_path: Path) -> None:
    result = client("lightning_client", "trainer", str(tmp_path), cwd=tmp_path)
    ok = tmp_path / "ok"
    assert result["finished"]
    assert all(is_gone(pid) for pid in rank_pids(ok))
    start, main, rank0, rank1 = (
        {name: t.numpy().tobytes() for name, t in torch_load(ok / f"{name}.pt").items()}
        for name in ("start", "main", "rank0", "rank1")
    )
    assert rank0 == rank1  # DDP kept the ranks' weights equal
    assert main == rank0  # the caller's model got the trained weights back
    assert main != start
    # Rank 1's training step raised: fit() raised its error, the trainer
    # recorded the interruption, and no rank was left when fit() returned.
    assert result["fail"] == rank_raised(tmp_path / "fail")
    assert result["fail_status"] == "interrupted"
    assert (result["ok_left"], result["fail_left"]) == ([], [])


def torch_load(path: Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path)
    return state


# accelerate -----------------------------------------------------------------


@needs("accelerate")
def test_accelerate_launchers_run_and_a_failing_rank_reaches_the_caller(tmp_path: Path) -> None:
    result = client("accelerate_client", str(tmp_path), cwd=tmp_path)
    for launcher in ("debug", "notebook"):
        out = tmp_path / launcher
        assert all(is_gone(pid) for pid in rank_pids(out)), launcher
        first, second = weights(out)
        assert first == second, launcher
    # debug_launcher again, rank 1 raising: its error reached the caller.
    assert result["debug_fail"] == rank_raised(tmp_path / "debug_fail")
    # notebook_launcher again, rank 1 raising: torch's elastic agent, polling
    # the ranks through aiospawn.sync, names it as the root cause.
    assert result["root_cause"] == {
        "rank": client_ranks.FAILING_RANK,
        "message": f"ValueError: {client_ranks.FAILURE}",
    }
    assert all(is_gone(pid) for pid in rank_pids(tmp_path / "notebook_fail"))
    assert (result["debug_left"], result["left"]) == ([], [])


@needs("accelerate")
def test_accelerate_debug_mode_explains_a_failed_environment_check(tmp_path: Path) -> None:
    # notebook_launcher with ACCELERATE_DEBUG_MODE runs a check in each rank
    # first, and catches torch's ProcessRaisedException to explain a failure.
    result = client("accelerate_client", str(tmp_path), "check", cwd=tmp_path)
    failed, cause = result["failed"], result["failed"]["cause"]
    assert failed["error"] == "RuntimeError"  # accelerate's, raised from ours
    assert failed["message"].startswith(
        "An issue was found when verifying a stable environment for the notebook launcher."
        "This likely stems from an outside import"
    )
    assert (cause["error"], cause["aiospawn"], cause["torch"]) == (
        "ProcessRaisedException",
        True,
        True,
    )
    # The reported rank is one that failed the check, with the pid it had and
    # its own error (each rank's message holds its pid). The other failed it
    # too, or was stopped first (a note is written whole or not at all).
    notes = [path.read_text().split() for path in tmp_path.glob("check*.pid")]
    assert len(notes) in (1, 2), notes
    assert all(leads == "1" for _, leads in notes), "a rank was not started by aiospawn"
    pids = [int(pid) for pid, _ in notes]
    assert cause["index"] in (0, 1)
    assert cause["pid"] in pids
    assert cause["cause"] == repr(
        RuntimeError(f"Cannot re-initialize CPU in forked subprocess (pid {cause['pid']})")
    )
    assert result["left"] == []
    assert all(is_gone(pid) for pid in pids)
