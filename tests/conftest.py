"""Shared fixtures: both anyio backends, and leak checks around every test.

Every test is checked for what it leaves behind: child processes (zombies
included), pipes and pidfds, and entries in the temp dir. Whatever the
interpreter sets up once per process (the forkserver, multiprocessing's temp
dir) is started before the first baseline is taken.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import Events, live_children, open_fds, wait_until


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session", autouse=True)
def _process_wide_setup() -> Iterator[None]:
    # A temp dir of our own, so that the temp-file check sees only what this
    # test run and its ranks write, whatever else runs on the machine.
    private = tempfile.mkdtemp(prefix="aiospawn-tests-")
    # Removed at interpreter exit, after multiprocessing has removed its own
    # temp dir inside it (exit priority -100; lower runs later).
    multiprocessing.util.Finalize(
        None, shutil.rmtree, args=(private,), kwargs={"ignore_errors": True}, exitpriority=-200
    )
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = private
    # Made once per interpreter and kept until exit: not a leak of any test.
    multiprocessing.util.get_temp_dir()
    multiprocessing.forkserver.ensure_running()
    # The leak check collects twice a test, and each collection walked the
    # 70,000 objects the suite imported (33 ms here; the whole suite took 16.5
    # rather than 12 minutes). Frozen, they are left alone: all are alive now
    # and stay so (one that became cyclic garbage would show as a leak, not
    # hide one).
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    if saved[0] is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]


@pytest.fixture
def events() -> Iterator[Events]:
    """A pipe the ranks report on: the test reads the first end, ranks get the second."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    yield reader, writer
    reader.close()
    writer.close()


@pytest.fixture
def no_process_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any ``Process.start()`` fail the test: the call must refuse before it."""

    def refuse(self: multiprocessing.process.BaseProcess) -> None:
        raise AssertionError(f"{self!r} was started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a child, a pipe or pidfd, or a temp file behind."""
    gc.collect()
    children = live_children()
    fds = open_fds()
    temp = set(os.listdir(tempfile.gettempdir()))
    yield
    gc.collect()
    assert wait_until(lambda: live_children() <= children), (
        f"processes left behind: {sorted(live_children() - children)}"
    )
    assert wait_until(lambda: open_fds() <= fds), f"fds left open: {sorted(open_fds() - fds)}"
    left = set(os.listdir(tempfile.gettempdir())) - temp
    assert not left, f"temp files left behind: {sorted(left)}"
