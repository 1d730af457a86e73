"""Rank output to files (``stdout=DIR``, ``--log-dir``): no link followed, no shared dir trusted.

The directory is opened once, without following a link, and refused unless it
is ours and only we can write to it; each file is opened relative to it, never
through a link, and checked (a regular file of ours, with no other hard link)
before it is emptied. A refusal is a ``ValueError`` raised before any rank
starts, and leaves every file as it was.
"""

from __future__ import annotations

import multiprocessing.process
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import aiospawn
from tests import ranks

pytestmark = pytest.mark.anyio

PRECIOUS = "precious contents\n"


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Made before the leak check's first baseline: not a leak of the first test.
    tmp_path_factory.getbasetemp()


@pytest.fixture
def no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any ``Process.start()`` fail the test: the call must refuse before it."""

    def refuse(self: Any) -> None:
        raise AssertionError(f"{self.name} was started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def read(path: Path) -> str:
    return path.read_text()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write(path: Path, text: str, bits: int) -> None:
    path.write_text(text)
    os.chmod(path, bits)


def names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    directory = tmp_path / "logs"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(PRECIOUS)
    return path


async def write_logs(directory: Path, *, tee: bool = False, nprocs: int = 2) -> None:
    await aiospawn.start_processes(
        ranks.out_hello,
        (2,),
        nprocs=nprocs,
        stdout=directory,
        stderr=directory,
        tee=tee,
        # Not fork: under pytest, a fork rank's sys.stdout is pytest's capture, not fd 1.
        start_method="spawn",
    )


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize("tee", [False, True], ids=["files", "tee"])
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_a_planted_symlink_is_refused_and_its_target_left_alone(
    logs: Path, victim: Path, stream: str, tee: bool
) -> None:
    link = logs / f"rank1.{stream}"
    link.symlink_to(victim)
    before = fd_count()
    with pytest.raises(ValueError, match=rf"rank1\.{stream}' is a symbolic link") as info:
        await write_logs(logs, tee=tee)
    assert "never follows links" in str(info.value)
    assert read(victim) == PRECIOUS
    assert mode(victim) == 0o644
    assert link.is_symlink()
    assert fd_count() == before  # the directory and rank 0's files were closed again


@pytest.mark.usefixtures("no_process_may_start")
async def test_a_dangling_symlink_creates_nothing(logs: Path, tmp_path: Path) -> None:
    target = tmp_path / "created-through-the-link"
    (logs / "rank0.stdout").symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        await write_logs(logs)
    assert not target.exists()


@pytest.mark.usefixtures("no_process_may_start")
async def test_a_hard_link_to_another_file_is_refused_before_it_is_emptied(
    logs: Path, victim: Path
) -> None:
    os.link(victim, logs / "rank0.stderr")
    with pytest.raises(ValueError, match=r"rank0\.stderr' has 1 other hard link"):
        await write_logs(logs)
    assert read(victim) == PRECIOUS


@pytest.mark.usefixtures("no_process_may_start")
async def test_a_fifo_is_refused_without_blocking(logs: Path) -> None:
    os.mkfifo(logs / "rank0.stdout", 0o600)
    with pytest.raises(ValueError, match="is not a regular file"):
        await write_logs(logs)


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize("bits", [0o777, 0o770, 0o1777, 0o720, 0o702], ids=oct)
async def test_a_directory_others_can_write_is_refused(logs: Path, bits: int) -> None:
    os.chmod(logs, bits)
    before = fd_count()
    with pytest.raises(ValueError, match="can be written by its group or others") as info:
        await write_logs(logs)
    assert f"mode {bits:04o}" in str(info.value)
    assert names(logs) == []
    assert fd_count() == before


@pytest.mark.usefixtures("no_process_may_start")
async def test_a_directory_that_is_a_link_is_refused(logs: Path, tmp_path: Path) -> None:
    link = tmp_path / "link-to-logs"
    link.symlink_to(logs)
    with pytest.raises(ValueError, match="is a symbolic link or not a directory"):
        await write_logs(link)
    assert names(logs) == []


async def test_missing_directories_are_made_0700_parents_too(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    await write_logs(target)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert mode(directory) == 0o700, directory
    assert names(target) == [
        "rank0.stderr",
        "rank0.stdout",
        "rank1.stderr",
        "rank1.stdout",
    ]


@pytest.mark.parametrize("tee", [False, True], ids=["files", "tee"])
async def test_an_existing_file_is_emptied_and_made_0600(logs: Path, tee: bool) -> None:
    old = logs / "rank0.stdout"
    write(old, "an older run's output, longer than this run's\n" * 10, 0o666)
    before = fd_count()
    await write_logs(logs, tee=tee)
    assert read(old) == "out 0 0\nout 0 1\n"
    for name in names(logs):
        assert mode(logs / name) == 0o600, name
    assert fd_count() == before  # the directory is closed with the group


@pytest.mark.parametrize("tee", [False, True], ids=["log-dir", "log-dir-tee"])
def test_the_launcher_refuses_a_planted_symlink_in_its_log_dir(
    logs: Path, victim: Path, tee: bool
) -> None:
    (logs / "rank0.stderr").symlink_to(victim)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiospawn",
            "run",
            "--log-dir",
            str(logs),
            *(["--tee"] if tee else []),
            "tests/cli_programs/show_env.py",
        ],
        cwd=Path(__file__).resolve().parent.parent,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2, completed.stderr  # refused before anything started
    assert "rank0.stderr' is a symbolic link" in completed.stderr
    assert read(victim) == PRECIOUS
