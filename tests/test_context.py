"""AsyncProcessContext: results, join semantics, repr, terminate(), cancelling join()."""

from __future__ import annotations

import logging
import multiprocessing
import signal
from typing import Any

import anyio
import pytest

import aiospawn
from tests import ranks
from tests.helpers import (
    Events,
    drain,
    is_reaped,
    is_running,
    receive,
    receive_ready,
    tripwire,
    wait_exits_seen,
)

# Its subject is the glue between the group and the event loop: both loops.
pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]


def aiospawn_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "aiospawn" and record.levelno >= level
    ]


# Results, pids, processes


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_join_false_returns_a_context_whose_join_gives_the_results(
    start_method: str,
) -> None:
    ctx = await aiospawn.start_processes(
        ranks.rank_times, (10,), nprocs=3, join=False, start_method=start_method
    )
    assert isinstance(ctx, aiospawn.AsyncProcessContext)
    assert len(ctx.processes) == 3
    assert ctx.pids() == [process.pid for process in ctx.processes]
    assert len(set(ctx.pids())) == 3
    assert await ctx.join() is True
    assert ctx.results == [0, 10, 20]


async def test_results_raise_runtime_error_until_join_returned_true() -> None:
    release = multiprocessing.get_context("spawn").Event()
    ctx = await aiospawn.start_processes(ranks.api_wait_for, (release, 3), nprocs=2, join=False)
    with pytest.raises(RuntimeError, match=r"await ctx\.join\(\) first"):
        ctx.results  # noqa: B018
    assert await ctx.join(timeout=0) is False
    with pytest.raises(RuntimeError, match=r"await ctx\.join\(\) first"):
        ctx.results  # noqa: B018
    release.set()
    assert await ctx.join() is True
    assert ctx.results == [0, 3]


# join(): timeouts, idempotence, concurrent callers


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_join_with_a_timeout_returns_false_and_leaves_the_ranks_running(
    start_method: str,
) -> None:
    release = multiprocessing.get_context(start_method).Event()
    ctx = await aiospawn.start_processes(
        ranks.api_wait_for, (release, 5), nprocs=2, join=False, start_method=start_method
    )
    assert await ctx.join(timeout=0) is False
    assert await ctx.join(timeout=0.2) is False
    assert all(is_running(pid) for pid in ctx.pids())
    assert repr(ctx) == "<AsyncProcessContext nprocs=2 running=2>"

    release.set()
    assert await ctx.join() is True
    assert await ctx.join() is True
    assert await ctx.join(timeout=0) is True
    assert ctx.results == [0, 5]
    assert repr(ctx) == "<AsyncProcessContext nprocs=2 running=0>"


async def test_join_after_a_failure_raises_an_equal_exception_every_time() -> None:
    ctx = await aiospawn.start_processes(ranks.raise_in, (1,), nprocs=2, join=False)
    with pytest.raises(aiospawn.ProcessRaisedException) as first:
        await ctx.join()
    assert first.value.error_index == 1
    # Rank 0 was still sleeping: we stopped it, so it is never the reported failure.
    assert ctx.processes[0].exitcode == -signal.SIGTERM

    for timeout in (None, 0, 0.1):
        with pytest.raises(aiospawn.ProcessException) as again:
            await ctx.join(timeout=timeout)
        assert type(again.value) is aiospawn.ProcessRaisedException
        assert again.value is not first.value
        assert again.value.error_index == 1
        assert again.value.error_pid == first.value.error_pid == ctx.pids()[1]
        assert again.value.msg == first.value.msg
        assert isinstance(again.value.__cause__, ValueError)


async def test_concurrent_joins_both_return_true() -> None:
    release = multiprocessing.get_context("spawn").Event()
    ctx = await aiospawn.start_processes(ranks.api_wait_for, (release, 2), nprocs=2, join=False)
    outcomes: list[bool] = []

    async def join() -> None:
        outcomes.append(await ctx.join())

    async with anyio.create_task_group() as tg:
        tg.start_soon(join)
        tg.start_soon(join)
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert outcomes == [True, True]
    assert ctx.results == [0, 2]


async def test_concurrent_joins_both_raise_the_same_failure(events: Events) -> None:
    reader, writer = events
    release = multiprocessing.get_context("spawn").Event()
    ctx = await aiospawn.start_processes(
        ranks.api_fail_on_release, (1, release, writer), nprocs=3, join=False
    )
    await receive_ready(reader, 2)
    errors: list[aiospawn.ProcessException] = []

    async def join() -> None:
        try:
            await ctx.join()
        except aiospawn.ProcessException as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(join)
        tg.start_soon(join)
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert [type(error) for error in errors] == [aiospawn.ProcessRaisedException] * 2
    assert {error.error_index for error in errors} == {1}
    assert {str(error) for error in errors} == {str(errors[0])}


# repr


@pytest.mark.parametrize(
    ("fn", "args", "nprocs", "expected"),
    [
        pytest.param(
            ranks.raise_in,
            (1,),
            2,
            "<AsyncProcessContext nprocs=2 running=0 failed=rank 1 (raised)>",
            id="raised",
        ),
        pytest.param(
            ranks.exit_with,
            (3,),
            1,
            "<AsyncProcessContext nprocs=1 running=0 failed=rank 0 (exit code 3)>",
            id="exit-code",
        ),
        pytest.param(
            ranks.kill_self,
            (signal.SIGKILL,),
            1,
            "<AsyncProcessContext nprocs=1 running=0 failed=rank 0 (SIGKILL)>",
            id="signal",
        ),
    ],
)
async def test_repr_names_the_failed_rank(
    fn: Any, args: tuple[Any, ...], nprocs: int, expected: str
) -> None:
    ctx = await aiospawn.start_processes(fn, args, nprocs=nprocs, join=False)
    with pytest.raises(aiospawn.ProcessException):
        await ctx.join()
    assert repr(ctx) == expected


# terminate()


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_terminate_is_idempotent_and_join_reports_the_lowest_stopped_rank(
    start_method: str, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    reader, writer = events
    ctx = await aiospawn.start_processes(
        ranks.api_record_sigterm, (writer,), nprocs=3, join=False, start_method=start_method
    )
    pids = await receive_ready(reader, 3)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ctx.terminate, 1)
        tg.start_soon(ctx.terminate, 1)
    await ctx.terminate(1)

    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1), ("SIGTERM", 2)]
    assert all(is_reaped(pid) for pid in pids.values())
    assert len(aiospawn_records(caplog, logging.WARNING)) == 3  # one SIGTERM per rank
    for _ in range(2):
        with pytest.raises(aiospawn.ProcessExitedException) as info:
            await ctx.join()
        assert info.value.error_index == 0
        assert info.value.error_pid == pids[0]
        assert info.value.exit_code == -signal.SIGTERM
        assert info.value.signal_name == "SIGTERM"
        assert "sent by aiospawn" in info.value.msg


async def test_terminate_reports_the_lowest_rank_it_stopped_not_one_that_returned(
    events: Events,
) -> None:
    reader, writer = events
    release = multiprocessing.get_context("spawn").Event()
    # Rank 0 returns (sys.exit(0)) once released; ranks 1 and 2 run until stopped.
    ctx = await aiospawn.start_processes(
        ranks.api_fail_on_release, (0, release, writer, False, 0), nprocs=3, join=False
    )
    await receive_ready(reader, 2)
    release.set()
    await wait_exits_seen(ctx, 0)

    await ctx.terminate(grace_period=1)

    with pytest.raises(aiospawn.ProcessExitedException) as info:
        await ctx.join()
    assert info.value.error_index == 1
    assert info.value.signal_name == "SIGTERM"
    assert ctx.processes[0].exitcode == 0
    assert sorted(drain(reader)) == [("SIGTERM", 1), ("SIGTERM", 2)]


async def test_terminate_after_every_rank_returned_leaves_join_true(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    ctx = await aiospawn.start_processes(ranks.identity, ("done",), nprocs=2, join=False)
    await wait_exits_seen(ctx, 0, 1)

    await ctx.terminate()
    await ctx.terminate()

    assert await ctx.join() is True
    assert ctx.results == ["done", "done"]
    assert aiospawn_records(caplog, logging.WARNING) == []


# Cancelling join()


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_cancelling_join_terminates_the_ranks_gracefully_then_propagates(
    start_method: str, events: Events
) -> None:
    reader, writer = events
    ctx = await aiospawn.start_processes(
        ranks.api_record_sigterm,
        (writer,),
        nprocs=2,
        join=False,
        start_method=start_method,
        grace_period=1,
    )
    pids = await receive_ready(reader, 2)
    scope = anyio.CancelScope()

    async def join() -> None:
        with scope:
            await ctx.join()

    async with anyio.create_task_group() as tg:
        tg.start_soon(join)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
    assert scope.cancelled_caught
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]
    assert all(is_reaped(pid) for pid in pids.values())
    # The group stays shut down: a later join() reports what the shutdown did.
    with pytest.raises(aiospawn.ProcessExitedException) as info:
        await ctx.join()
    assert (info.value.error_index, info.value.signal_name) == (0, "SIGTERM")


async def test_a_second_cancellation_of_join_does_not_abandon_the_ranks(
    events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    reader, writer = events
    ctx = await aiospawn.start_processes(
        ranks.api_record_sigterm, (writer, True), nprocs=2, join=False, grace_period=1
    )
    pids = await receive_ready(reader, 2)
    outer = anyio.CancelScope()
    inner = anyio.CancelScope()

    async def join() -> None:
        with outer, inner:
            await ctx.join()

    async with anyio.create_task_group() as tg:
        tg.start_soon(join)
        await anyio.wait_all_tasks_blocked()
        inner.cancel()
        # Both ranks got SIGTERM and ignore it: the grace period is running.
        assert {await receive(reader, "SIGTERM report") for _ in range(2)} == {
            ("SIGTERM", 0),
            ("SIGTERM", 1),
        }
        outer.cancel()
    assert outer.cancelled_caught or inner.cancelled_caught
    assert all(is_reaped(pid) for pid in pids.values())
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGKILL, -signal.SIGKILL]
    assert sum("SIGKILL" in message for message in aiospawn_records(caplog, logging.WARNING)) == 2


# The event loop keeps running


async def test_the_loop_keeps_running_while_join_waits() -> None:
    release = multiprocessing.get_context("spawn").Event()
    ctx = await aiospawn.start_processes(ranks.api_wait_for, (release,), nprocs=2, join=False)
    ticked = anyio.Event()
    joined = anyio.Event()

    async def ticker() -> None:
        for _ in range(20):
            await anyio.sleep(0.01)
        ticked.set()

    async def join() -> None:
        assert await ctx.join() is True
        joined.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(join)
        tg.start_soon(ticker)
        with anyio.fail_after(30):  # a loop blocked by join() would never tick
            await ticked.wait()
        assert not joined.is_set()
        release.set()
    assert ctx.results == [0, 1]


async def test_a_shorter_grace_period_hurries_a_shutdown_under_way(events: Events) -> None:
    reader, writer = events
    # Both ranks ignore SIGTERM; the group's own grace period is a minute.
    ctx = await aiospawn.start_processes(
        ranks.api_record_sigterm, (writer, True), nprocs=2, join=False, grace_period=60
    )
    pids = await receive_ready(reader, 2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ctx.terminate)
        assert {await receive(reader, "SIGTERM report") for _ in range(2)} == {
            ("SIGTERM", 0),
            ("SIGTERM", 1),
        }
        with tripwire(30, "terminate(grace_period=0) hurrying the shutdown"):
            await ctx.terminate(grace_period=0)
    assert [process.exitcode for process in ctx.processes] == [-signal.SIGKILL] * 2
    assert all(is_reaped(pid) for pid in pids.values())
