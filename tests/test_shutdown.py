"""Shutdown escalation: grace wait, SIGTERM to every live rank at once, SIGKILL, bounded reap."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal

import anyio
import pytest

import aiospawn
import aiospawn._core._shutdown
from aiospawn._core._context import group_of
from aiospawn._local._rank import LocalRank
from tests import ranks
from tests.helpers import Events, drain, is_reaped, receive_ready

# Its subject is the glue between the group and the event loop: both loops.
pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The messages logged on the "aiospawn" logger at exactly ``level``."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "aiospawn" and record.levelno == level
    ]


def sigterm_record(pid: int, rank: int) -> str:
    return f"Terminating process {pid} via signal SIGTERM (rank {rank})"


@pytest.fixture(autouse=True)
def _capture_aiospawn_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aiospawn")


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_siblings_that_exit_within_the_grace_period_are_not_signalled(
    start_method: str, caplog: pytest.LogCaptureFixture
) -> None:
    failed = multiprocessing.get_context(start_method).Event()
    ctx = await aiospawn.start_processes(
        ranks.api_fail_or_follow,
        (1, failed),
        nprocs=3,
        join=False,
        start_method=start_method,
        grace_period=10,
    )
    start = anyio.current_time()
    with pytest.raises(aiospawn.ProcessRaisedException) as info:
        await ctx.join()
    assert anyio.current_time() - start < 8, "join() waited out the grace period"
    assert info.value.error_index == 1
    assert [process.exitcode for process in ctx.processes] == [0, 1, 0]
    assert records(caplog, logging.WARNING) == []
    assert records(caplog, logging.ERROR) == []


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_ranks_ignoring_sigterm_are_killed_and_reaped_before_join_raises(
    start_method: str, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = events
    release = multiprocessing.get_context(start_method).Event()
    # Rank 2 raises; ranks 0 and 1 report SIGTERM and ignore it.
    ctx = await aiospawn.start_processes(
        ranks.api_fail_on_release,
        (2, release, writer, True),
        nprocs=3,
        join=False,
        start_method=start_method,
        grace_period=0.5,
    )
    pids = await receive_ready(reader, 2)
    release.set()

    with pytest.raises(aiospawn.ProcessRaisedException) as info:
        await ctx.join()

    # The root cause, although the lower ranks died too (of our SIGKILL).
    assert info.value.error_index == 2
    assert isinstance(info.value.__cause__, ValueError)
    assert all(is_reaped(pid) for pid in ctx.pids())
    assert [process.exitcode for process in ctx.processes] == [-signal.SIGKILL] * 2 + [1]
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 4
    # Both SIGTERMs went out before either SIGKILL.
    assert set(warnings[:2]) == {sigterm_record(pids[0], 0), sigterm_record(pids[1], 1)}
    for message in warnings[2:]:
        assert "SIGKILL" in message
    assert {warnings[2].split()[1], warnings[3].split()[1]} == {str(pids[0]), str(pids[1])}


@pytest.mark.parametrize("exit_code", [None, 3], ids=["raised", "exited"])
async def test_the_reported_failure_is_never_a_rank_we_stopped(
    exit_code: int | None, events: Events
) -> None:
    reader, writer = events
    release = multiprocessing.get_context("spawn").Event()
    # Rank 0 dies of the SIGTERM we send it, a failure of a lower rank than the real one.
    ctx = await aiospawn.start_processes(
        ranks.api_fail_on_release, (1, release, writer, False, exit_code), nprocs=2, join=False
    )
    await receive_ready(reader, 1)
    release.set()
    with pytest.raises(aiospawn.ProcessException) as info:
        await ctx.join()
    assert info.value.error_index == 1
    if exit_code is None:
        assert type(info.value) is aiospawn.ProcessRaisedException
    else:
        assert type(info.value) is aiospawn.ProcessExitedException
        assert info.value.exit_code == exit_code
    assert ctx.processes[0].exitcode == -signal.SIGTERM
    assert drain(reader) == [("SIGTERM", 0)]


@pytest.mark.alone  # it bounds a duration
async def test_ranks_ignoring_sigterm_cost_one_grace_period_not_one_each(
    events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = events
    ctx = await aiospawn.start_processes(
        ranks.api_record_sigterm, (writer, True), nprocs=3, join=False
    )
    pids = await receive_ready(reader, 3)

    start = anyio.current_time()
    await ctx.terminate(grace_period=1.5)
    elapsed = anyio.current_time() - start

    # One after another would take 4.5 s; together, one grace period.
    assert 1.4 <= elapsed < 3.0
    assert all(is_reaped(pid) for pid in pids.values())
    warnings = records(caplog, logging.WARNING)
    assert set(warnings[:3]) == {sigterm_record(pids[rank], rank) for rank in range(3)}
    assert all("SIGKILL" in message for message in warnings[3:])
    assert len(warnings) == 6


async def test_a_rank_that_cannot_be_reaped_is_reported_instead_of_waited_for(
    events: Events, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, writer = events
    release = multiprocessing.get_context("spawn").Event()
    monkeypatch.setattr(aiospawn._core._shutdown, "REAP_TIMEOUT", 0.5)
    send_signal = LocalRank.send_signal

    def lose_sigkill(self: LocalRank, signum: int) -> bool:
        if signum == signal.SIGKILL:
            return True  # as if the rank were in uninterruptible sleep
        return send_signal(self, signum)

    monkeypatch.setattr(LocalRank, "send_signal", lose_sigkill)
    # Rank 1 raises; rank 0 ignores SIGTERM, and the SIGKILL never reaches it.
    ctx = await aiospawn.start_processes(
        ranks.api_fail_on_release,
        (1, release, writer, True),
        nprocs=2,
        join=False,
        grace_period=0.5,
    )
    pids = await receive_ready(reader, 1)
    try:
        release.set()
        for _ in range(2):  # and every later join() says the same
            with pytest.raises(aiospawn.ProcessRaisedException) as info:
                await ctx.join()
            assert info.value.error_index == 1
            notes = getattr(info.value, "__notes__", [])
            assert len(notes) == 1
            assert f"rank 0 (pid {pids[0]}) did not exit after SIGKILL" in notes[0]
            assert "uninterruptible sleep" in notes[0]
        [error] = records(caplog, logging.ERROR)
        assert error.startswith(f"Process {pids[0]} (rank 0) did not exit 0.5 s after SIGKILL")
        assert "uninterruptible sleep" in error
    finally:
        os.kill(pids[0], signal.SIGKILL)  # what the kernel would do once the rank wakes up
        with anyio.fail_after(30):
            await group_of(ctx).attempt(0).wait()  # reap it and close its pipes
