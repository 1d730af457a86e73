"""The async entry points: start_processes, spawn and open_group.

Results, argument checks, open_group's task-group semantics, cancellation of
a call or block that owns a group, and an event loop that keeps running.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import threading
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import pytest

import aiospawn
from aiospawn._local._limits import max_nprocs
from tests import ranks
from tests.helpers import (
    Events,
    cancel_once_ready,
    drain,
    is_reaped,
    live_children,
    receive,
    receive_ready,
    tripwire,
)

pytestmark = pytest.mark.anyio

#: More than a pipe buffer: a start that sends it stays in flight until the rank reads it.
BIG = b"x" * (1 << 20)


async def enter(entry: str, fn: Any, args: Any = (), nprocs: Any = 1, **kwargs: Any) -> None:
    """Start a group through ``entry``: start_processes, spawn, or an open_group block."""
    if entry == "open_group":
        async with aiospawn.open_group(fn, args, nprocs, **kwargs):
            pytest.fail("the open_group block ran")
    else:
        await getattr(aiospawn, entry)(fn, args, nprocs, **kwargs)


ENTRIES = pytest.mark.parametrize("entry", ["start_processes", "spawn", "open_group"])


# Results


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_start_processes_returns_the_results_in_rank_order(start_method: str) -> None:
    results = await aiospawn.start_processes(
        ranks.rank_times, (10,), nprocs=3, start_method=start_method
    )
    assert results == [0, 10, 20]


async def test_spawn_returns_the_results_or_a_context() -> None:
    assert await aiospawn.spawn(ranks.rank_times, (2,), nprocs=2) == [0, 2]
    ctx = await aiospawn.spawn(ranks.rank_times, (3,), nprocs=2, join=False)
    assert isinstance(ctx, aiospawn.AsyncProcessContext)
    assert await ctx.join() is True
    assert ctx.results == [0, 3]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
async def test_spawn_with_another_start_method_warns_and_uses_spawn(start_method: str) -> None:
    with pytest.warns(FutureWarning, match=r"aiospawn\.start_processes") as warned:
        ctx = await aiospawn.spawn(
            ranks.identity, ("v",), nprocs=2, join=False, start_method=start_method
        )
    assert warned[0].filename == __file__  # blames the caller
    assert all(type(p) is multiprocessing.context.SpawnProcess for p in ctx.processes)
    assert await ctx.join() is True
    assert ctx.results == ["v", "v"]


# Bad input, rejected before any process starts


@ENTRIES
@pytest.mark.parametrize("nprocs", [0, -1, True, 1.5, "2"])
@pytest.mark.usefixtures("no_process_start")
async def test_an_invalid_nprocs_is_rejected(entry: str, nprocs: Any) -> None:
    with pytest.raises(ValueError, match=r"nprocs must be a positive int, got "):
        await enter(entry, ranks.identity, (), nprocs)


@ENTRIES
@pytest.mark.usefixtures("no_process_start")
async def test_an_nprocs_over_the_limit_is_rejected_naming_the_limit(entry: str) -> None:
    limit = max_nprocs()
    if limit >= 10**6:
        pytest.skip(f"this machine's limits allow {limit} ranks")
    with pytest.raises(ValueError, match=rf"nprocs=1000000 .*\({limit}, from RLIMIT_NOFILE"):
        await enter(entry, ranks.identity, (), 10**6)


@ENTRIES
@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        pytest.param("ranks.identity", (), "fn must be callable", id="fn-not-callable"),
        pytest.param(ranks.identity, 5, "args must be a tuple or list", id="args-not-a-sequence"),
    ],
)
@pytest.mark.usefixtures("no_process_start")
async def test_a_bad_fn_or_args_is_a_type_error(entry: str, fn: Any, args: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        await enter(entry, fn, args, 2)


@pytest.mark.parametrize("entry", ["start_processes", "open_group"])
@pytest.mark.usefixtures("no_process_start")
async def test_an_unknown_start_method_is_rejected(entry: str) -> None:
    with pytest.raises(ValueError, match=r"start_method must be one of .*got 'spwan'"):
        await enter(entry, ranks.identity, (), 2, start_method="spwan")


@ENTRIES
@pytest.mark.parametrize("grace_period", [-1, float("nan")])
@pytest.mark.usefixtures("no_process_start")
async def test_a_negative_grace_period_is_rejected(entry: str, grace_period: float) -> None:
    with pytest.raises(ValueError, match=r"grace_period must be a non-negative number"):
        await enter(entry, ranks.identity, (), 2, grace_period=grace_period)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_a_lambda_local_function_or_local_class_runs_under_every_start_method(
    start_method: str,
) -> None:
    factor = 7

    class Offset:
        def __init__(self, by: int) -> None:
            self.by = by

    def local_rank_fn(rank: int, offset: Offset) -> int:
        return rank * factor + offset.by

    doubled = await aiospawn.start_processes(
        lambda rank: rank * 2, nprocs=2, start_method=start_method
    )
    assert doubled == [0, 2]
    results = await aiospawn.start_processes(
        local_rank_fn, (Offset(1),), nprocs=2, start_method=start_method
    )
    assert results == [1, 8]

    # A local fn whose argument is a lambda: the whole payload goes by value.
    def apply(rank: int, fn: Any) -> Any:
        return fn(rank)

    assert await aiospawn.start_processes(
        apply, (lambda rank: rank + 3,), nprocs=2, start_method=start_method
    ) == [3, 4]
    async with aiospawn.open_group(lambda rank: -rank, nprocs=2, start_method=start_method) as ctx:
        pass
    assert ctx.results == [0, -1]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_local_function_gets_the_pipes_among_its_arguments(
    start_method: str, events: Events
) -> None:
    reader, writer = events

    def report(rank: int, events: Any) -> None:
        events.send(("hello", rank))

    # By value, yet the pipe reaches the rank as a descriptor, as by reference.
    await aiospawn.start_processes(report, (writer,), nprocs=2, start_method=start_method)
    assert sorted(drain(reader)) == [("hello", 0), ("hello", 1)]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.usefixtures("no_process_start")
async def test_a_fn_that_cannot_be_sent_even_by_value_is_refused_before_any_rank_starts(
    start_method: str,
) -> None:
    lock = threading.Lock()

    def holds_a_lock(rank: int) -> bool:
        return lock.locked()

    expected = (
        r"fn <function .*holds_a_lock.*> cannot be pickled, even by value.*start_method='fork'"
    )
    with pytest.raises(TypeError, match=expected):
        await aiospawn.start_processes(holds_a_lock, nprocs=2, start_method=start_method)
    with pytest.raises(TypeError, match=expected):
        async with aiospawn.open_group(holds_a_lock, nprocs=2, start_method=start_method):
            pytest.fail("the open_group block ran")


async def test_a_lambda_or_local_function_works_under_fork() -> None:
    factor = 7

    def local_rank_fn(rank: int) -> int:
        return rank * factor

    doubled = await aiospawn.start_processes(lambda rank: rank * 2, nprocs=2, start_method="fork")
    assert doubled == [0, 2]
    assert await aiospawn.start_processes(local_rank_fn, nprocs=2, start_method="fork") == [0, 7]


@pytest.mark.parametrize("value", [-1, float("nan")])
async def test_negative_timeouts_and_grace_periods_of_a_started_group_are_rejected(
    value: float,
) -> None:
    ctx = await aiospawn.start_processes(ranks.identity, ("ok",), nprocs=2, join=False)
    with pytest.raises(ValueError, match=r"timeout must be a non-negative number"):
        await ctx.join(timeout=value)
    with pytest.raises(ValueError, match=r"grace_period must be a non-negative number"):
        await ctx.join(grace_period=value)
    with pytest.raises(ValueError, match=r"grace_period must be a non-negative number"):
        await ctx.terminate(grace_period=value)
    # The group was not touched.
    assert await ctx.join() is True
    assert ctx.results == ["ok", "ok"]


# open_group


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_open_group_exit_waits_for_every_rank(start_method: str) -> None:
    release = multiprocessing.get_context(start_method).Event()
    async with aiospawn.open_group(
        ranks.api_wait_for, (release, 4), nprocs=2, start_method=start_method
    ) as ctx:
        assert len(ctx.pids()) == 2
        assert await ctx.join(timeout=0) is False
        release.set()
    assert ctx.results == [0, 4]
    assert [process.exitcode for process in ctx.processes] == [0, 0]


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [
        pytest.param(None, aiospawn.ProcessRaisedException, id="raised"),
        pytest.param(3, aiospawn.ProcessExitedException, id="exited"),
    ],
)
async def test_open_group_exit_raises_the_failing_ranks_exception_itself(
    exit_code: int | None, expected: type[aiospawn.ProcessException], events: Events
) -> None:
    reader, writer = events
    release = multiprocessing.get_context("spawn").Event()

    async def block() -> None:
        async with aiospawn.open_group(
            ranks.api_fail_on_release, (1, release, writer, False, exit_code), nprocs=2
        ):
            await receive_ready(reader, 1)
            release.set()

    with pytest.raises(aiospawn.ProcessException) as info:
        await block()
    assert type(info.value) is expected
    assert info.value.error_index == 1
    assert drain(reader) == [("SIGTERM", 0)]


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_an_exception_in_the_block_stops_the_ranks_and_propagates_unchanged(
    start_method: str, events: Events
) -> None:
    reader, writer = events
    error = RuntimeError("the block failed")
    pids: dict[int, int] = {}

    async def block() -> None:
        async with aiospawn.open_group(
            ranks.api_record_sigterm, (writer,), nprocs=2, start_method=start_method
        ):
            pids.update(await receive_ready(reader, 2))
            raise error

    with pytest.raises(RuntimeError) as info:
        await block()
    assert info.value is error
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]
    assert all(is_reaped(pid) for pid in pids.values())


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
@pytest.mark.both_loops
async def test_a_rank_failing_cancels_the_blocked_body_and_the_block_raises_its_exception(
    start_method: str,
) -> None:
    pids: list[int] = []
    body_went_on = False

    async def block() -> None:
        nonlocal body_went_on
        async with aiospawn.open_group(
            ranks.raise_in, (1,), nprocs=2, start_method=start_method
        ) as ctx:
            pids.extend(ctx.pids())
            await anyio.sleep_forever()
            body_went_on = True

    start = anyio.current_time()
    with pytest.raises(aiospawn.ProcessException) as info:
        await block()
    assert type(info.value) is aiospawn.ProcessRaisedException
    assert info.value.error_index == 1
    assert not body_went_on
    assert anyio.current_time() - start < 20  # not the 30 s default grace period
    assert all(is_reaped(pid) for pid in pids)


# Cancellation


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
@pytest.mark.both_loops
async def test_cancelling_start_processes_terminates_the_ranks_gracefully(
    start_method: str, events: Events
) -> None:
    reader, writer = events
    start = partial(
        aiospawn.start_processes,
        ranks.api_record_sigterm,
        (writer,),
        nprocs=2,
        start_method=start_method,
        grace_period=1,
    )
    pids = await cancel_once_ready(start, reader, 2)
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]
    assert all(is_reaped(pid) for pid in pids.values())


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
@pytest.mark.both_loops
async def test_cancelling_the_scope_around_open_group_terminates_the_ranks_gracefully(
    start_method: str, events: Events
) -> None:
    reader, writer = events

    async def supervise() -> None:
        async with aiospawn.open_group(
            ranks.api_record_sigterm,
            (writer,),
            nprocs=2,
            start_method=start_method,
            grace_period=1,
        ):
            await anyio.sleep_forever()

    pids = await cancel_once_ready(supervise, reader, 2)
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]
    assert all(is_reaped(pid) for pid in pids.values())


@pytest.mark.both_loops
async def test_a_second_cancellation_does_not_abandon_the_ranks(
    events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    reader, writer = events
    outer = anyio.CancelScope()
    inner = anyio.CancelScope()

    async def run() -> None:
        with outer, inner:
            await aiospawn.start_processes(
                ranks.api_record_sigterm, (writer, True), nprocs=2, grace_period=1
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        pids = await receive_ready(reader, 2)
        await anyio.wait_all_tasks_blocked()
        inner.cancel()
        # Both ranks got SIGTERM and ignore it: the grace period is running.
        reports = {await receive(reader, "SIGTERM report") for _ in range(2)}
        assert reports == {("SIGTERM", 0), ("SIGTERM", 1)}
        outer.cancel()
    assert outer.cancelled_caught or inner.cancelled_caught
    assert all(is_reaped(pid) for pid in pids.values())
    kills = [r.getMessage() for r in caplog.records if "SIGKILL" in r.getMessage()]
    assert len(kills) == 2


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.both_loops
async def test_cancelling_while_the_ranks_start_leaves_no_process_behind(
    start_method: str, events: Events, release: Events
) -> None:
    reader, writer = events
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await aiospawn.start_processes(
                ranks.api_sleep_with,
                (ranks.ApiHeldArg(writer, release[0]), BIG),
                nprocs=2,
                start_method=start_method,
                grace_period=1,
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        # Both ranks are reading their arguments: both starts are in flight.
        pids = [(await receive(reader, "unpickling message"))[1] for _ in range(2)]
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        release[1].send(None)  # the ranks' imports finish; the starts complete
    assert scope.cancelled_caught
    assert all(is_reaped(pid) for pid in pids)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.both_loops
async def test_a_start_cancelled_while_it_waits_for_a_thread_ends_and_starts_nothing(
    start_method: str,
) -> None:
    # Every worker thread is taken when the start wants one: the cancellation
    # lands before any rank has started, and once a thread is free the start
    # must end without starting a rank.
    await aiospawn.start_processes(ranks.identity, nprocs=1, start_method=start_method)
    children_before = live_children()
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens = limiter.total_tokens
    limiter.total_tokens = 1
    free = threading.Event()
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await aiospawn.start_processes(ranks.sleep_forever, nprocs=2, start_method=start_method)

    try:
        with tripwire(60, "a start cancelled while it waited for a thread"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(anyio.to_thread.run_sync, free.wait))
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(run)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                free.set()
    finally:
        free.set()
        limiter.total_tokens = tokens
    assert scope.cancelled_caught
    assert live_children() - children_before == set()


# The event loop keeps running


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.both_loops
async def test_the_loop_keeps_running_while_the_ranks_start(
    start_method: str, events: Events, release: Events
) -> None:
    reader, writer = events
    ticked = anyio.Event()
    results: list[int] = []

    async def ticker() -> None:
        for _ in range(20):
            await anyio.sleep(0.01)
        ticked.set()

    async def run() -> None:
        results.extend(
            await aiospawn.start_processes(
                ranks.api_return_rank,
                (ranks.ApiHeldArg(writer, release[0]), BIG),
                nprocs=2,
                start_method=start_method,
            )
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        for _ in range(2):
            await receive(reader, "unpickling message")
        tg.start_soon(ticker)
        with anyio.fail_after(30):  # a loop blocked by the starts would never tick
            await ticked.wait()
        assert results == []
        release[1].send(None)
    assert results == [0, 1]
