"""Processes a rank leaves behind end with the rank, wherever they went.

Each escape route starts a process that outlives what ``fn`` did: a child in
the rank's own process group, one in a session of its own
(``start_new_session=True``), either of them ignoring SIGTERM, and a classic
daemon (fork, ``setsid()``, fork: an orphan in another session). Whether the rank returns, ends by
``os._exit``, is stopped by ``terminate()``, or its supervisor is SIGKILLed,
the escapee must be gone (checked by pid with psutil, retried briefly).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import aiospawn
from tests import escape_ranks
from tests.conftest import wait_until
from tests.helpers import Events, receive, tripwire

pytestmark = pytest.mark.anyio

START_METHODS = ["spawn", "fork", "forkserver"]
ROUTES = list(escape_ranks.ESCAPES)
SUPERVISOR = Path(__file__).resolve().parent / "escape_supervisor.py"


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has ended: it only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def killed_if_left(pids: list[int]) -> Iterator[None]:
    """After a failed check, SIGKILL what the test found alive, so the next tests run clean."""
    try:
        yield
    finally:
        for pid in pids:
            if is_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def assert_gone(pid: int, how: str) -> None:
    assert wait_until(lambda: not is_alive(pid), 5), f"the {how} escapee {pid} is still running"


@pytest.mark.parametrize("how", ROUTES)
@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_returning_rank_takes_its_leftover_processes_with_it(
    start_method: str, how: str
) -> None:
    with tripwire(60, f"a rank that returns after leaving a {how} escapee"):
        (escapee,) = await aiospawn.start_processes(
            escape_ranks.escape, (how,), start_method=start_method
        )
    with killed_if_left([escapee]):
        assert_gone(escapee, how)


@pytest.mark.parametrize("end", ["os._exit", "execv"])
@pytest.mark.parametrize("how", ROUTES)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_a_rank_ending_outside_its_bootstrap_takes_its_process_group_with_it(
    start_method: str, how: str, end: str, events: Events
) -> None:
    # os._exit and execv skip the rank's own sweep: what is left in its
    # process group is killed by the supervisor before it reaps the rank
    # (under forkserver the fork server reaps it first, so only the sweep
    # applies there). Outside the group, nothing reaches it: a known limit.
    reader, writer = events
    with tripwire(60, f"a rank that ends by {end} after leaving an escapee"):
        ctx = await aiospawn.start_processes(
            escape_ranks.escape_then_end,
            (how, end, writer),
            join=False,
            start_method=start_method,
        )
        escapee = await receive(reader, "the escapee's pid")
        # Exit 0 without a result frame: success or a failure, not the point here.
        with contextlib.suppress(aiospawn.ProcessException):
            await ctx.join()
    with killed_if_left([escapee]):
        if how.startswith("group"):
            assert_gone(escapee, how)
        else:
            assert is_alive(escapee)


@pytest.mark.parametrize("how", ROUTES)
@pytest.mark.parametrize("start_method", START_METHODS)
async def test_terminate_stops_the_processes_of_a_running_rank(
    start_method: str, how: str, events: Events
) -> None:
    reader, writer = events
    ctx = await aiospawn.start_processes(
        escape_ranks.escape_then_wait,
        (how, writer),
        join=False,
        start_method=start_method,
        grace_period=10,
    )
    rank, escapee = await receive(reader, "the rank's and the escapee's pids")
    with killed_if_left([escapee]):
        with tripwire(60, "terminate() of a rank with an escapee"):
            await ctx.terminate()
        assert not is_alive(rank)
        assert_gone(escapee, how)


def _supervise(how: str, start_method: str) -> None:
    # A SIGKILLed supervisor cannot remove multiprocessing's temp dir (the fork
    # server's socket lives there): it gets one of its own, removed here.
    tmp = tempfile.mkdtemp(prefix="aiospawn-escape-supervisor-")
    supervisor = subprocess.Popen(
        [sys.executable, str(SUPERVISOR), how, start_method],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "TMPDIR": tmp},
    )
    pids: list[int] = []
    try:
        assert supervisor.stdout is not None
        ready, _, _ = select.select([supervisor.stdout], [], [], 60)
        line = supervisor.stdout.readline() if ready else b""
        if not line:
            supervisor.kill()
            _, err = supervisor.communicate()
            raise AssertionError(f"the supervisor reported nothing:\n{err.decode()}")
        report = json.loads(line)
        pids = [report["rank"], report["escapee"]]
        assert all(is_alive(pid) for pid in pids), report
        if not how.startswith("group"):
            assert os.getsid(report["escapee"]) != os.getsid(report["rank"]), report
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        for pid, what in zip(pids, ("rank", how), strict=True):
            assert wait_until(lambda pid=pid: not is_alive(pid), 5), (
                f"the {what} {pid} survived its SIGKILLed supervisor: {report}"
            )
    finally:
        for pid in pids:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor.pid, signal.SIGKILL)  # its fork server and resource tracker
        supervisor.kill()
        supervisor.communicate()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("how", ROUTES)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_escapees_die_with_a_sigkilled_supervisor(start_method: str, how: str) -> None:
    _supervise(how, start_method)
