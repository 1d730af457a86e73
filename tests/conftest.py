"""Shared fixtures: the event loops a test runs on, tests that run alone, leak checks.

Event loops: a test that takes ``anyio_backend`` (every ``@pytest.mark.anyio``
test) runs on asyncio; a test marked ``both_loops``, whose subject is the glue
between aiospawn and the event loop, runs on asyncio and on trio. ``--loops``
changes that for a run: ``--loops trio`` runs every test on trio, ``--loops
both`` every test on both (CI runs one interpreter with ``--loops trio``).

Parallel runs: the suite runs on pytest-xdist's workers. A test marked
``alone`` runs while no other test runs, on any worker: each test holds a
shared lock on a file of the run, an ``alone`` test an exclusive one.

Every test is checked for what it leaves behind: child processes (zombies
included), pipes and pidfds, and entries in the temp dir. Whatever the
interpreter sets up once per process (the forkserver, multiprocessing's temp
dir) is started before the first baseline is taken.
"""

from __future__ import annotations

import fcntl
import gc
import importlib.util
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import Events, live_children, open_fds, wait_until

LOOPS = {"asyncio": ["asyncio"], "trio": ["trio"], "both": ["asyncio", "trio"]}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--loops",
        choices=sorted(LOOPS),
        default="asyncio",
        help="the event loops every test runs on (both_loops tests run on both anyway)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        # An xdist worker's __main__ is execnet's `python -c` bootstrap, which a
        # spawn rank cannot import again: aiospawn would treat every group as
        # a notebook's and send fn and args by value. Make it what `python -m
        # pytest` has, a main module imported by name, which ranks skip.
        main = sys.modules["__main__"]
        if getattr(main, "__spec__", None) is None:
            main.__spec__ = importlib.util.find_spec("pytest.__main__")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run ``alone`` tests first, then ``slow`` ones, then the rest, each in file order.

    An ``alone`` test waits for every test running elsewhere to end, and
    they for it: at the start, when the other workers run ``alone`` tests
    too, that costs least. Long tests started early do not end a run alone.
    """
    items.sort(
        key=lambda item: (
            0 if item.get_closest_marker("alone") else 1 if item.get_closest_marker("slow") else 2
        )
    )


@pytest.fixture
def anyio_backend() -> str:
    """The loop a test runs on: replaced by the parameters below (anyio's has its own)."""
    return "asyncio"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``anyio_backend``, unless the test names its loops itself."""
    if "anyio_backend" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        if "anyio_backend" in mark.args[0]:
            return
    if metafunc.definition.get_closest_marker("both_loops"):
        loops = LOOPS["both"]
    else:
        loops = LOOPS[metafunc.config.getoption("loops")]
    metafunc.parametrize("anyio_backend", loops, ids=loops)


class RunLock:
    """A readers-writer lock across the workers of one run, made of two locked files.

    Every test holds ``main`` shared, an ``alone`` test exclusively. An
    ``alone`` test takes ``turnstile`` first and keeps it while it waits for
    ``main``, and every test passes the turnstile on its way in: tests that
    start meanwhile queue behind the ``alone`` test instead of starving it.
    """

    def __init__(self, directory: Path) -> None:
        self.main = os.open(directory / "aiospawn-run.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.turnstile = os.open(
            directory / "aiospawn-run.turnstile", os.O_RDWR | os.O_CREAT, 0o600
        )

    @contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.main, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.main)
        os.close(self.turnstile)


@pytest.fixture(scope="session")
def _run_lock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunLock | None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield None  # one process runs the tests: each runs alone
        return
    # A worker's basetemp is inside the run's own (pytest-xdist names it after
    # the worker): that parent is one directory for the whole run, new each run.
    lock = RunLock(tmp_path_factory.getbasetemp().parent)
    yield lock
    lock.close()


@pytest.fixture(autouse=True)
def _alone_or_shared(request: pytest.FixtureRequest, _run_lock: RunLock | None) -> Iterator[None]:
    """Hold the run's lock: exclusively for an ``alone`` test, shared for the others."""
    if _run_lock is None:
        yield
        return
    with _run_lock.held(alone=request.node.get_closest_marker("alone") is not None):
        yield


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
def release() -> Iterator[Events]:
    """A pipe that releases ranks: they wait on the first end, the test sends on the second.

    Not a ``multiprocessing.Event``: its ``set()`` blocks for good once a rank
    killed in its ``wait()`` leaves it counting a sleeper that never wakes.
    """
    waiter, sender = multiprocessing.Pipe(duplex=False)
    yield waiter, sender
    waiter.close()
    sender.close()


@pytest.fixture
def no_process_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any ``Process.start()`` fail the test: the call must refuse before it."""

    def refuse(self: multiprocessing.process.BaseProcess) -> None:
        raise AssertionError(f"{self!r} was started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a child, a pipe or pidfd, or a temp file behind.

    Or if it changed ``sys.path`` or the current directory: the next tests in
    this process, and their spawn ranks, would import from elsewhere.
    """
    gc.collect()
    path, cwd = list(sys.path), os.getcwd()
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
    assert (sys.path, os.getcwd()) == (path, cwd), "sys.path or the current directory changed"
