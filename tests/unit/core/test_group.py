"""The group supervisor on the fake backend: fail-fast, root causes, restarts, hangs.

No process starts here: each rank is a ``FakeRank`` whose starts, beats and
exits the test decides (``tests/fake_backend.py``), on a clock the test moves.
What only real processes show (signals, reaping, pipes) is tested elsewhere.
"""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any

import anyio
import pytest

import aiospawn
from aiospawn._core._restarts import HISTORY_TAIL, NOTE_RECORDS
from tests.fake_backend import FakeBackend, start_group
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio

FAST = aiospawn.Backoff(initial=0)


async def join_while(
    ctx: aiospawn.AsyncProcessContext[Any], drive: Callable[[], Coroutine[Any, Any, None]]
) -> bool:
    """``ctx.join()`` while ``drive()`` plays the ranks' part; raises what ``join()`` raised."""
    error: aiospawn.ProcessException | None = None
    with anyio.fail_after(10):  # a deadlock tripwire: nothing here waits for real time
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            try:
                joined = await ctx.join()
            except aiospawn.ProcessException as exc:
                error = exc
    if error is not None:
        raise error
    return joined


def same_error(first: BaseException, second: BaseException) -> bool:
    assert isinstance(first, aiospawn.ProcessException)
    assert isinstance(second, aiospawn.ProcessException)
    return (type(first), first.error_index, str(first)) == (
        type(second),
        second.error_index,
        str(second),
    )


async def test_ranks_that_return_give_their_results_in_rank_order() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=3)
    for rank in (2, 0, 1):
        backend.attempt(rank).returns(rank * 10)
    assert await ctx.join() is True
    assert ctx.results == [0, 10, 20]
    assert await ctx.join() is True
    assert backend.launcher is not None
    assert backend.launcher.closed


async def test_join_only_asks_whether_ranks_exited_and_the_owner_alone_records_the_exits() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=2)
    backend.attempt(0).returns(0)
    # Exited a moment ago, not recorded yet: join(0) still sees it, and waits
    # for the owner's watch to record it rather than reaping it itself.
    assert backend.attempt(0).exit is None
    assert await ctx.join(0) is False
    assert backend.attempt(0).recorded_by == "wait"
    backend.attempt(1).returns(1)
    assert await ctx.join(0) is True
    assert [backend.attempt(rank).recorded_by for rank in (0, 1)] == ["wait", "wait"]
    assert ctx.results == [0, 1]


async def test_the_first_failure_stops_the_others_and_every_join_raises_it_again() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=3)
    backend.attempt(2).raises(ValueError("boom"))
    with pytest.raises(aiospawn.ProcessRaisedException) as first:
        await ctx.join()
    assert first.value.error_index == 2
    assert isinstance(first.value.__cause__, ValueError)
    # The others were stopped, and died of it: never the root cause, though lower.
    for rank in (0, 1):
        assert backend.attempt(rank).signals == [signal.SIGTERM]
        exit = backend.attempt(rank).exit
        assert exit is not None
        assert exit.stopped_by_us
    for _ in range(2):
        with pytest.raises(aiospawn.ProcessRaisedException) as again:
            await ctx.join()
        assert same_error(again.value, first.value)
        assert again.value is not first.value


@pytest.mark.parametrize(("first", "blamed"), [(1, 1), (0, 0)])
async def test_of_failures_found_at_once_the_one_that_ended_first_is_the_root_cause(
    first: int, blamed: int
) -> None:
    # Both exits are there when join() polls, as for a supervisor that polls
    # (torch's elastic agent): the time each rank ended decides, not its index.
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=3)
    backend.attempt(first).raises(ValueError("first"), at=100.0)
    backend.attempt(1 - first).raises(RuntimeError("because of it"), at=100.5)
    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        await ctx.join()
    assert caught.value.error_index == blamed
    assert isinstance(caught.value.__cause__, ValueError)
    assert f"failed=rank {blamed}" in repr(ctx)


async def test_after_terminate_join_reports_the_lowest_rank_stopped() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=3, grace_period=0)
    backend.ignored_signals = {signal.SIGTERM}
    backend.attempt(0).returns()
    await ctx.terminate()
    assert backend.attempt(0).signals == []  # it had exited: never signalled
    for rank in (1, 2):
        assert backend.attempt(rank).signals == [signal.SIGTERM, signal.SIGKILL]
    with pytest.raises(aiospawn.ProcessExitedException, match="SIGKILL") as caught:
        await ctx.join()
    assert caught.value.error_index == 1


async def test_a_hurried_shutdown_logs_the_time_since_sigterm_not_the_grace_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=1)  # 30 s from SIGTERM to SIGKILL
    backend.ignored_signals = {signal.SIGTERM}
    rank = backend.attempt(0)
    with tripwire(10, "the hurried shutdown"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctx.terminate)
            await anyio.wait_all_tasks_blocked()  # the shutdown waits out the grace period
            assert rank.signals == [signal.SIGTERM]
            sigterm_seen = anyio.current_time()
            # Real time must pass for the log to report it (as a user's pause
            # before a second Ctrl-C); nothing waits on this sleep.
            await anyio.sleep(0.3)
            waited = anyio.current_time() - sigterm_seen
            await ctx.terminate(grace_period=0)  # the second Ctrl-C
    assert rank.signals == [signal.SIGTERM, signal.SIGKILL]
    [line] = [r.getMessage() for r in caplog.records if "after SIGTERM" in r.getMessage()]
    match = re.fullmatch(
        rf"Process {rank.pid} \(rank 0\) still running (\d+\.\d) s after SIGTERM;"
        " sending SIGKILL",
        line,
    )
    assert match, line
    # At least the time the test saw pass (one decimal), far less than the 30 s.
    assert round(waited, 1) <= float(match[1]) < 10


async def test_a_start_error_names_the_lowest_failing_rank_and_stops_the_started() -> None:
    backend = FakeBackend()
    backend.fail_start[2, 0] = OSError("no more processes")
    backend.fail_start[1, 0] = OSError("no more fds")
    with pytest.raises(OSError, match="no more fds") as caught:
        await start_group(backend, nprocs=3)
    assert caught.value.__notes__ == ["aiospawn: raised while starting rank 1 of 3"]
    assert backend.attempt(0).signals == [signal.SIGTERM]
    assert backend.attempt(1).discarded
    assert backend.attempt(2).discarded


async def test_restarts_beyond_the_intensity_give_up_with_the_last_failure() -> None:
    backend = FakeBackend()
    policy = aiospawn.RestartPolicy(max_restarts=2, window=60, backoff=FAST)
    ctx = await start_group(backend, nprocs=1, restart=policy)

    async def fail_every_run() -> None:
        for attempt in range(3):
            (await backend.started(0, attempt)).raises(ValueError(f"run {attempt}"))

    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        await join_while(ctx, fail_every_run)
    error = caught.value
    assert str(error.__cause__) == "run 2"
    assert [record.restart for record in error.restarts] == [0, 1, 2]
    assert any("restart policy gave up" in note for note in error.__notes__)
    assert ctx.statistics().restarts == 2


async def test_restarts_spread_over_more_than_a_window_never_give_up() -> None:
    backend = FakeBackend()
    policy = aiospawn.RestartPolicy(max_restarts=1, window=60, backoff=FAST)
    ctx = await start_group(backend, nprocs=1, restart=policy)

    async def fail_once_a_window() -> None:
        for attempt in range(5):
            rank = await backend.started(0, attempt)
            backend.clock.advance(61)
            rank.exits(3)
        (await backend.started(0, 5)).returns("done")

    assert await join_while(ctx, fail_once_a_window) is True
    assert ctx.results == ["done"]


async def test_one_for_all_stops_the_group_and_starts_every_rank_again() -> None:
    backend = FakeBackend()
    policy = aiospawn.RestartPolicy(strategy="one_for_all", backoff=FAST)
    ctx = await start_group(backend, nprocs=2, restart=policy)

    async def fail_rank_1_once() -> None:
        backend.attempt(1, 0).exits(3)
        for rank in (0, 1):
            (await backend.started(rank, 1)).returns(rank)

    assert await join_while(ctx, fail_rank_1_once) is True
    assert backend.attempt(0, 0).signals == [signal.SIGTERM]
    assert backend.launcher is not None
    assert backend.launcher.rendezvous == 1
    assert ctx.statistics().restarts == 1


async def test_one_for_one_starts_the_failed_rank_alone_and_leaves_the_others() -> None:
    backend = FakeBackend()
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=FAST)
    ctx = await start_group(backend, nprocs=2, restart=policy)

    async def fail_rank_1_once() -> None:
        backend.attempt(1, 0).exits(3)
        (await backend.started(1, 1)).returns(1)
        backend.attempt(0, 0).returns(0)

    assert await join_while(ctx, fail_rank_1_once) is True
    assert [made.restart for made in backend.made if made.rank == 0] == [0]
    assert backend.attempt(0, 0).signals == []
    assert backend.launcher is not None
    assert backend.launcher.rendezvous == 0
    assert [rank.restarts for rank in ctx.statistics().ranks] == [0, 1]


async def test_the_backoff_grows_with_the_restarts_inside_the_window() -> None:
    backend = FakeBackend()
    backoff = aiospawn.Backoff(initial=10, factor=2, max=100)
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=backoff)
    ctx = await start_group(backend, nprocs=2, restart=policy)
    delays: list[tuple[int, float]] = []

    async def fail_both_and_watch() -> None:
        async with aclosing(ctx.events()) as events:
            backend.attempt(0).raises(ValueError("first"))
            async for event in events:
                if isinstance(event, aiospawn.Restarting):
                    delays.append((event.rank, event.delay))
                    if len(delays) == 1:
                        backend.clock.advance(5)
                        backend.attempt(1).raises(ValueError("second"))
                    else:
                        break
        await ctx.terminate()

    with pytest.raises(aiospawn.ProcessRaisedException):
        await join_while(ctx, fail_both_and_watch)
    assert delays == [(0, 10.0), (1, 20.0)]
    # The restarts dropped by terminate() never happened.
    assert len(backend.made) == 2


async def test_a_rank_that_stops_beating_is_hung_and_stopped_at_once() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=2, heartbeat_timeout=10, grace_period=5)

    async def stop_beating() -> None:
        for rank in (0, 1):
            backend.attempt(rank).heartbeat()
        backend.clock.advance(11)
        backend.attempt(1).returns()  # the group looks at its ranks afresh

    with pytest.raises(aiospawn.ProcessHungException) as caught:
        await join_while(ctx, stop_beating)
    assert caught.value.error_index == 0
    assert caught.value.seconds == 11
    assert caught.value.stack == "stack of rank 0"
    assert backend.attempt(0).signals == [signal.SIGTERM]


async def test_a_rank_that_beat_once_cannot_hang_with_a_startup_timeout_alone() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=2, startup_timeout=5)

    async def beat_then_run_long() -> None:
        for rank in (0, 1):
            backend.attempt(rank).heartbeat()
        backend.clock.advance(100)
        backend.attempt(1).returns(1)
        await anyio.wait_all_tasks_blocked()  # the heartbeat watcher has looked again
        backend.attempt(0).returns(0)

    assert await join_while(ctx, beat_then_run_long) is True
    assert ctx.results == [0, 1]


async def test_a_rank_that_never_beats_is_hung_after_the_startup_timeout() -> None:
    backend = FakeBackend()
    ctx = await start_group(backend, nprocs=2, startup_timeout=5, heartbeat_timeout=60)

    async def never_beat() -> None:
        backend.attempt(1).heartbeat()
        backend.clock.advance(5)
        backend.attempt(1).returns()

    with pytest.raises(aiospawn.ProcessHungException, match="startup_timeout") as caught:
        await join_while(ctx, never_beat)
    assert caught.value.error_index == 0


async def test_the_restart_history_of_a_group_restarted_forever_stays_bounded() -> None:
    # on="any" restarts a rank after each return: over a long life the group
    # saw thousands of them, and kept (and reported) every one.
    backend = FakeBackend()
    policy = aiospawn.RestartPolicy(max_restarts=3, window=60, backoff=FAST, on="any")
    ctx = await start_group(backend, nprocs=1, restart=policy)

    async def return_for_long_then_fail_fast() -> None:
        for attempt in range(200):
            rank = await backend.started(0, attempt)
            backend.clock.advance(100)
            rank.returns()
        for attempt in range(200, 204):
            rank = await backend.started(0, attempt)
            if attempt == 200:
                backend.clock.advance(100)  # the returns' restarts leave the window
            rank.raises(ValueError(f"run {attempt}"))

    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        await join_while(ctx, return_for_long_then_fail_fast)
    restarts = caught.value.restarts
    assert len(restarts) <= policy.max_restarts + 1 + HISTORY_TAIL
    assert [record.restart for record in restarts[-4:]] == [200, 201, 202, 203]
    [note] = [note for note in caught.value.__notes__ if "restart policy gave up" in note]
    assert len(note.splitlines()) == NOTE_RECORDS + 1
