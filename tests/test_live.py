"""Live ranks on the local backend: async rank functions, readiness, channels, collective calls.

What the supervisor and its ranks say to each other while the group runs.
Supervisors on asyncio and trio (the ``anyio_backend`` fixture); ranks sync,
or ``async def`` on asyncio or trio (``rank_loop``). One test runs every
start method; the others use ``fork``, the quickest to start, except where
a start method changes what is tested. Rank functions: ``tests/live_ranks.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
import pytest

import aiospawn
from aiospawn import ProcessExitedException, ProcessRaisedException
from tests import live_ranks
from tests.helpers import receive, send_storm, tripwire

pytestmark = pytest.mark.anyio

FAST = aiospawn.Backoff(initial=0.0)

#: How each kind of rank runs: its function's variant, and the group's options.
KINDS: dict[str, dict[str, Any]] = {
    "sync": {},
    "asyncio": {"rank_loop": "asyncio"},
    "trio": {"rank_loop": "trio"},
}


def kind_of(name: str, fn: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``live_ranks.<fn>`` (or its ``_async`` variant) and the options for rank kind ``name``."""
    suffix = "" if name == "sync" else "_async"
    return getattr(live_ranks, fn + suffix), KINDS[name]


@asynccontextmanager
async def group(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    start_method: str = "fork",
    seconds: float = 60,
    what: str = "a live group",
    **options: Any,
) -> AsyncIterator[aiospawn.AsyncProcessContext[Any]]:
    """``open_group`` under a deadlock tripwire."""
    with tripwire(seconds, what):
        async with aiospawn.open_group(
            fn, args, nprocs=nprocs, start_method=start_method, **options
        ) as ctx:
            yield ctx


# ---------------------------------------------------------------- async fn


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_an_async_fn_returns_its_value_on_the_loop_asked_for(
    anyio_backend: str, start_method: str, rank_loop: str
) -> None:
    with tripwire(60, f"an async rank on {rank_loop} under {start_method}"):
        results = await aiospawn.start_processes(
            live_ranks.return_async,
            ("value",),
            nprocs=2,
            start_method=start_method,
            rank_loop=rank_loop,
        )
    assert results == [(0, "value", rank_loop), (1, "value", rank_loop)]


@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_an_async_fn_that_raises_fails_the_group_with_its_exception(
    anyio_backend: str, rank_loop: str
) -> None:
    with (
        tripwire(60, "join() of a group whose async rank raised"),
        pytest.raises(ProcessRaisedException) as info,
    ):
        await aiospawn.start_processes(
            live_ranks.raise_async, (1,), nprocs=2, start_method="fork", rank_loop=rank_loop
        )
    assert info.value.error_index == 1
    assert isinstance(info.value.__cause__, live_ranks.RankError)
    assert str(info.value.__cause__) == "raised in async rank 1"


@pytest.mark.parametrize("rank_loop", ["curio", "", None, 1])
async def test_a_bad_rank_loop_is_refused_before_anything_starts(
    anyio_backend: str, no_process_start: None, rank_loop: object
) -> None:
    with pytest.raises(ValueError, match="rank_loop"):
        await aiospawn.start_processes(
            live_ranks.return_async, ("value",), nprocs=1, rank_loop=rank_loop
        )
    with pytest.raises(ValueError, match="rank_loop"):
        async with aiospawn.open_group(live_ranks.return_async, ("value",), rank_loop=rank_loop):
            pytest.fail("the block ran")


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
@pytest.mark.both_loops
async def test_sigterm_cancels_an_async_rank_and_its_cleanup_runs(
    anyio_backend: str, start_method: str, rank_loop: str
) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            live_ranks.clean_up_async,
            (writer,),
            nprocs=2,
            join=False,
            start_method=start_method,
            rank_loop=rank_loop,
        )
        with tripwire(60, "terminating async ranks"):
            pids = await ctx.wait_ready()
            await ctx.terminate()
            events = [event async for event in ctx.events()]  # closed by the shutdown
            with pytest.raises(ProcessExitedException) as info:
                await ctx.join()
        cleaned = sorted([await receive(reader, "cleanup report") for _ in range(2)])
    assert cleaned == [("cleaned", rank, pids[rank], rank_loop) for rank in range(2)]
    exits = [event for event in events if isinstance(event, aiospawn.Exited)]
    assert sorted(event.rank for event in exits) == [0, 1]
    for event in exits:
        assert event.exit_code == -signal.SIGTERM
        assert event.stopped_by_us
    assert info.value.error_index == 0
    assert info.value.exit_code == -signal.SIGTERM


@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_a_second_sigterm_ends_an_async_rank_stuck_in_its_cleanup(
    anyio_backend: str, rank_loop: str
) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            live_ranks.stuck_in_cleanup_async,
            (writer,),
            nprocs=1,
            join=False,
            start_method="fork",
            rank_loop=rank_loop,
        )
        with tripwire(60, "a second SIGTERM to an async rank"):
            (pid,) = await ctx.wait_ready()
            os.kill(pid, signal.SIGTERM)
            assert await receive(reader, "cleanup report") == ("in cleanup", 0)
            os.kill(pid, signal.SIGTERM)
            with pytest.raises(ProcessExitedException) as info:
                await ctx.join()
        assert not reader.poll(0), "the cleanup finished: the second SIGTERM did not end it"
    assert info.value.exit_code == -signal.SIGTERM


# ---------------------------------------------------------------- readiness


@pytest.mark.parametrize("kind", ["sync", "asyncio", "trio"])
@pytest.mark.both_loops
async def test_wait_ready_returns_the_payloads_in_rank_order(anyio_backend: str, kind: str) -> None:
    fn, options = kind_of(kind, "ready_then_drain")
    async with group(fn, nprocs=3, what="wait_ready()", **options) as ctx:
        payloads = await ctx.wait_ready()
        assert [payload["rank"] for payload in payloads] == [0, 1, 2]
        if kind == "sync":
            assert [payload["pid"] for payload in payloads] == ctx.pids()
        else:
            assert {payload["loop"] for payload in payloads} == {kind}
        assert [rank.ready for rank in ctx.statistics().ranks] == [True, True, True]
        ready = []
        async with aclosing(ctx.events()) as events:  # from the group's first event
            async for event in events:
                if isinstance(event, aiospawn.Ready):
                    ready.append((event.rank, event.pid))
                    if len(ready) == 3:
                        break
        assert sorted(ready) == list(enumerate(ctx.pids()))
    assert ctx.results == [0, 1, 2]


@pytest.mark.both_loops
async def test_open_group_with_wait_ready_enters_once_every_rank_is_ready(
    anyio_backend: str,
) -> None:
    with tripwire(60, "open_group(wait_ready=True)"):
        async with aiospawn.open_group(
            live_ranks.ready_then_drain, nprocs=2, start_method="fork", wait_ready=True
        ) as ctx:
            assert [rank.ready for rank in ctx.statistics().ranks] == [True, True]
    assert ctx.results == [0, 1]


async def test_a_rank_that_fails_before_it_is_ready_fails_wait_ready(anyio_backend: str) -> None:
    ctx = await aiospawn.start_processes(
        live_ranks.fail_before_ready, (1,), nprocs=2, join=False, start_method="fork"
    )
    with tripwire(60, "wait_ready() on a failed rank"):
        with pytest.raises(ProcessRaisedException) as info:
            await ctx.wait_ready()
        assert ctx.statistics().alive == 0  # the group was shut down first
    assert info.value.error_index == 1
    assert isinstance(info.value.__cause__, live_ranks.RankError)


async def test_a_rank_that_fails_before_it_is_ready_fails_open_group_wait_ready(
    anyio_backend: str,
) -> None:
    with (
        tripwire(60, "open_group(wait_ready=True) with a failed rank"),
        pytest.raises(ProcessRaisedException) as info,
    ):
        async with aiospawn.open_group(
            live_ranks.fail_before_ready, (1,), nprocs=2, start_method="fork", wait_ready=True
        ):
            pytest.fail("the block ran")
    assert info.value.error_index == 1


async def test_wait_ready_counts_a_restarted_rank_once_its_new_attempt_is_ready(
    anyio_backend: str,
) -> None:
    first_ready = multiprocessing.Pipe(duplex=False)
    restarted = multiprocessing.Pipe(duplex=False)
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=FAST)
    try:
        async with group(
            live_ranks.ready_after_restart,
            first_ready,
            restarted,
            restart=policy,
            what="wait_ready() across a restart",
        ) as ctx:
            # Rank 0 calls ready() only once rank 1's second attempt runs, and
            # that attempt only once rank 0 is ready: the first attempt's
            # readiness must not count.
            payloads = await ctx.wait_ready()
            assert payloads == [("rank 0", 0), ("rank 1", 1)]
            assert [rank.restarts for rank in ctx.statistics().ranks] == [0, 1]
    finally:
        for end in (*first_ready, *restarted):
            end.close()


async def test_wait_ready_refuses_a_group_whose_rank_returned_unready(
    anyio_backend: str,
) -> None:
    ctx = await aiospawn.start_processes(
        live_ranks.return_at_once, nprocs=2, join=False, start_method="fork"
    )
    with (
        tripwire(60, "wait_ready() on ranks that returned"),
        pytest.raises(RuntimeError, match=r"before every rank called aiospawn.ready\(\)"),
    ):
        await ctx.wait_ready()
    assert await ctx.join()
    assert ctx.results == [0, 1]


async def test_wait_ready_times_out_naming_the_unready_rank(anyio_backend: str) -> None:
    async with group(live_ranks.never_ready, 1, what="a wait_ready() that times out") as ctx:
        with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not call aiospawn.ready\(\)"):
            await ctx.wait_ready(timeout=0.5)
        assert [rank.ready for rank in ctx.statistics().ranks] == [True, False]
    assert ctx.results == [None, None]  # the group kept running, and ended at the block's end


async def test_startup_timeout_bounds_open_group_wait_ready(anyio_backend: str) -> None:
    with (
        tripwire(60, "open_group(wait_ready=True, startup_timeout=...)"),
        pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not"),
    ):
        async with aiospawn.open_group(
            live_ranks.never_ready,
            (1,),
            nprocs=2,
            start_method="fork",
            wait_ready=True,
            startup_timeout=0.5,
        ):
            pytest.fail("the block ran")


async def test_a_ready_rank_that_never_beats_is_not_hung_after_startup_timeout(
    anyio_backend: str,
) -> None:
    async with group(
        live_ranks.serve, wait_ready=True, startup_timeout=0.5, what="serving past startup"
    ) as ctx:
        # Not a synchronisation: the point is that startup_timeout passes.
        await anyio.sleep(1.5)
        assert await ctx.call("whoami") == [0, 1]
        assert [rank.state for rank in ctx.statistics().ranks] == ["running", "running"]
    assert ctx.results == ["served", "served"]


# ----------------------------------------------------------------- channels


@pytest.mark.parametrize("kind", ["sync", "asyncio", "trio"])
@pytest.mark.both_loops
async def test_messages_go_both_ways_in_order(anyio_backend: str, kind: str) -> None:
    fn, options = kind_of(kind, "echo")
    async with group(fn, what="an echo round trip", **options) as ctx:
        for rank in range(2):
            channel = ctx.channel(rank)
            for seq in range(20):
                await channel.send({"seq": seq, "to": rank})
            assert [await channel.receive() for _ in range(20)] == [
                (rank, {"seq": seq, "to": rank}) for seq in range(20)
            ]
    assert ctx.results == [20, 20]


@pytest.mark.parametrize("how", ["close", "return"])
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_receive_ends_with_end_of_stream_once_the_rank_closes_or_returns(
    anyio_backend: str, kind: str, how: str
) -> None:
    fn, options = kind_of(kind, "send_then_end")
    release_reader, release_writer = multiprocessing.Pipe(duplex=False)
    with release_reader, release_writer:
        async with group(
            fn, 5, how, release_reader, nprocs=1, what="receive() to the end", **options
        ) as ctx:
            channel = ctx.channel(0)
            # With "close", the rank waits for the release meanwhile: the end
            # of the stream is its close(), not its exit.
            assert [message async for message in channel] == [0, 1, 2, 3, 4]
            with pytest.raises(anyio.EndOfStream):
                await channel.receive()
            release_writer.send("return now")
    assert ctx.results == [None]


@pytest.mark.both_loops
async def test_a_send_blocks_while_the_rank_does_not_read(anyio_backend: str) -> None:
    go_reader, go_writer = multiprocessing.Pipe(duplex=False)
    chunk = b"x" * (64 << 10)
    count = 512  # 32 MB: far more than any socket and queue hold
    sent = 0
    with go_reader, go_writer:
        async with group(
            live_ranks.read_when_told, go_reader, nprocs=1, what="back-pressure"
        ) as ctx:
            channel = ctx.channel(0)

            async def send_all() -> None:
                nonlocal sent
                for seq in range(count):
                    await channel.send((seq, chunk))
                    sent += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all)
                await anyio.wait_all_tasks_blocked()
                # The rank reads nothing yet: the sender waits after a bounded amount.
                held = sent
                assert held < count
                assert held * len(chunk) < 8 << 20, f"{held} messages went out unread"
                go_writer.send("read now")
            assert sent == count
    assert ctx.results == [(1, list(range(count)))]


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_send_eof_ends_the_ranks_receive_and_its_messages_still_come(
    anyio_backend: str, kind: str
) -> None:
    fn, options = kind_of(kind, "echo")
    async with group(fn, nprocs=1, what="send_eof()", **options) as ctx:
        channel = ctx.channel(0)
        for seq in range(3):
            await channel.send(seq)
        await channel.send_eof()
        with pytest.raises(anyio.ClosedResourceError):
            await channel.send("after send_eof")
        # The rank's loop ends at EOF, and it returns: its echoes, then the end.
        assert [message async for message in channel] == [(0, 0), (0, 1), (0, 2)]
    assert ctx.results == [3]


@pytest.mark.both_loops
async def test_send_eof_while_a_send_waits_for_a_rank_that_does_not_read(
    anyio_backend: str,
) -> None:
    go_reader, go_writer = multiprocessing.Pipe(duplex=False)
    sent = 0
    refused: list[BaseException] = []
    with go_reader, go_writer:
        async with group(
            live_ranks.read_when_told, go_reader, nprocs=1, what="send_eof() behind a send()"
        ) as ctx:
            channel = ctx.channel(0)

            async def send_all() -> None:
                nonlocal sent
                try:
                    for seq in range(512):
                        await channel.send((seq, b"x" * (64 << 10)))
                        sent += 1
                except anyio.ClosedResourceError as exc:
                    refused.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all)
                # A first frame is out (the socket takes it whole); the ones
                # after it fill the socket, and a send then waits for it. A
                # blocked task may also be pickling on a worker thread: the
                # send_eof() below refuses that send as well.
                while not sent:
                    await anyio.wait_all_tasks_blocked()
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(channel.send_eof)
                await anyio.wait_all_tasks_blocked()
                go_writer.send("read now")
    assert refused, "send() went on after send_eof()"
    # What was sent arrived, and nothing after the end of the stream.
    assert ctx.results == [(1, list(range(sent)))]


async def test_a_send_waiting_for_a_rank_that_dies_raises_its_failure(
    anyio_backend: str,
) -> None:
    go_reader, go_writer = multiprocessing.Pipe(duplex=False)
    raised: list[BaseException] = []
    with go_reader, go_writer:
        ctx = await aiospawn.start_processes(
            live_ranks.die_when_told, (0, go_reader), nprocs=1, join=False, start_method="fork"
        )
        with tripwire(60, "send() to a rank that died"):
            await ctx.wait_ready()
            channel = ctx.channel(0)

            async def send_until_refused() -> None:
                try:
                    for seq in range(512):  # the rank reads none of them
                        await channel.send((seq, b"x" * (64 << 10)))
                except ProcessExitedException as exc:
                    raised.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_until_refused)
                await anyio.wait_all_tasks_blocked()
                go_writer.send("die")
            with pytest.raises(ProcessExitedException):
                await ctx.join()
    (error,) = raised
    assert isinstance(error, ProcessExitedException)
    assert error.exit_code == 7


@pytest.mark.parametrize("kind", ["sync", "trio"])
async def test_a_4_mb_message_goes_both_ways(anyio_backend: str, kind: str) -> None:
    await _large_round_trip(kind, 4 << 20)


@pytest.mark.slow
async def test_a_100_mb_message_goes_both_ways(anyio_backend: str) -> None:
    await _large_round_trip("sync", 100 << 20)


async def _large_round_trip(kind: str, size: int) -> None:
    fn, options = kind_of(kind, "echo")
    payload = os.urandom(size)
    async with group(fn, nprocs=1, seconds=120, what=f"a {size >> 20} MB echo", **options) as ctx:
        channel = ctx.channel(0)
        await channel.send(payload)
        rank, echoed = await channel.receive()
        assert rank == 0
        assert echoed == payload


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
@pytest.mark.both_loops
async def test_a_pending_receive_raises_the_failure_of_a_rank_that_dies(
    anyio_backend: str, start_method: str
) -> None:
    # Rank 0 dies: under fork, ranks 1 and 2 were forked after its channel was
    # made, and must not hold its end open (the receive would never end).
    go_reader, go_writer = multiprocessing.Pipe(duplex=False)
    raised: list[BaseException] = []
    with go_reader, go_writer:
        ctx = await aiospawn.start_processes(
            live_ranks.die_when_told,
            (0, go_reader),
            nprocs=3,
            join=False,
            start_method=start_method,
        )
        with tripwire(60, "receive() from a rank that died"):
            await ctx.wait_ready()

            async def receive_from_0() -> None:
                try:
                    await ctx.channel(0).receive()
                except ProcessExitedException as exc:
                    raised.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive_from_0)
                await anyio.wait_all_tasks_blocked()
                go_writer.send("die")
            with pytest.raises(ProcessExitedException):
                await ctx.join()
    (error,) = raised
    assert isinstance(error, ProcessExitedException)
    assert error.error_index == 0
    assert error.exit_code == 7


async def test_messages_a_rank_sent_before_it_raised_come_before_its_failure(
    anyio_backend: str,
) -> None:
    ctx = await aiospawn.start_processes(
        live_ranks.send_then_raise, (3,), nprocs=1, join=False, start_method="fork"
    )
    with tripwire(60, "receive() from a rank that raised"):
        channel = ctx.channel(0)
        assert [await channel.receive() for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ProcessRaisedException) as info:
            await channel.receive()
        with pytest.raises(ProcessRaisedException):
            await ctx.join()
    assert isinstance(info.value.__cause__, live_ranks.RankError)


async def test_the_channel_of_a_rank_that_returned_ends_cleanly(anyio_backend: str) -> None:
    ctx = await aiospawn.start_processes(
        live_ranks.return_at_once, nprocs=1, join=False, start_method="fork"
    )
    with tripwire(60, "join()"):
        assert await ctx.join()
    channel = ctx.channel(0)
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()
    with pytest.raises(anyio.BrokenResourceError):
        await channel.send("to a rank that returned")


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_after_aclose_the_channel_is_closed_both_ways(
    anyio_backend: str, start_method: str
) -> None:
    # Three ranks: no sibling (forked with every channel made) may hold rank
    # 1's channel open, or its send would not be refused.
    async with group(
        live_ranks.receive_one_after_close,
        nprocs=3,
        start_method=start_method,
        what="aclose()",
    ) as ctx:
        channel = ctx.channel(1)
        await channel.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await channel.receive()
        with pytest.raises(anyio.ClosedResourceError):
            await channel.send("after aclose")
        await channel.aclose()  # idempotent
    assert ctx.results == ["sent", "send refused", "sent"]


@pytest.mark.parametrize("strategy", ["one_for_one", "one_for_all"])
async def test_a_restarted_rank_gets_a_new_channel_and_none_of_the_old_messages(
    anyio_backend: str, strategy: Any
) -> None:
    die_reader, die_writer = multiprocessing.Pipe(duplex=False)
    policy = aiospawn.RestartPolicy(strategy=strategy, backoff=FAST)
    with die_reader, die_writer:
        async with group(
            live_ranks.first_message_per_attempt,
            die_reader,
            restart=policy,
            what="a channel across a restart",
        ) as ctx:
            assert await ctx.wait_ready() == [0, 0]
            first, old = ctx.channel(0), ctx.channel(1)
            for seq in range(3):
                await old.send(f"for the first attempt {seq}")  # buffered, never read
            die_writer.send("die")
            with pytest.raises(ProcessExitedException) as info:
                await old.receive()
            assert info.value.exit_code == 3
            # The death was seen: the restarted attempts must be ready again.
            restarted = 1 if strategy == "one_for_all" else 0
            assert await ctx.wait_ready() == [restarted, 1]
            assert (ctx.channel(0) is not first) == (strategy == "one_for_all")
            new = ctx.channel(1)
            assert new is not old
            with pytest.raises(ProcessExitedException):
                await old.send("to the dead attempt")
            await new.send("for the second attempt")
            assert await new.receive() == (1, "for the second attempt")


# --------------------------------------------------------- cancellation storms


def deadlines(seed: int, count: int, longest: float = 0.002) -> list[float]:
    """Tiny random deadlines up to ``longest``, some zero (cancelled at the first checkpoint)."""
    rng = random.Random(seed)
    return [rng.choice([0.0, rng.uniform(0, longest)]) for _ in range(count)]


STORM = pytest.param(200, id="200")
STORM_SLOW = pytest.param(3000, id="3000", marks=pytest.mark.slow)


@pytest.mark.parametrize("iterations", [STORM, STORM_SLOW])
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
@pytest.mark.both_loops
async def test_a_send_storm_loses_and_duplicates_nothing(
    anyio_backend: str, kind: str, iterations: int
) -> None:
    fn, options = kind_of(kind, "echo")
    async with group(fn, nprocs=1, seconds=120, what="a send storm", **options) as ctx:
        # Up to 240 kB: a send often waits for the socket, then is cancelled.
        _, echoed = await send_storm(
            ctx.channel(0), deadlines(seq_seed(kind), iterations), lambda seq: seq % 7 * 40_000
        )
    assert ctx.results == [len(echoed) + 1]


def seq_seed(kind: str) -> int:
    return sum(map(ord, kind))


@pytest.mark.parametrize("iterations", [STORM, STORM_SLOW])
@pytest.mark.parametrize("kind", ["sync", "trio"])
async def test_a_receive_storm_loses_and_duplicates_nothing(
    anyio_backend: str, kind: str, iterations: int
) -> None:
    fn, options = kind_of(kind, "send_sized")
    received = []
    async with group(
        fn, iterations, nprocs=1, seconds=120, what="a receive storm", **options
    ) as ctx:
        channel = ctx.channel(0)
        rng = random.Random(iterations)
        while True:
            with anyio.move_on_after(rng.choice([0.0, rng.uniform(0, 0.002)])):
                try:
                    seq, payload = await channel.receive()
                except anyio.EndOfStream:
                    break
                assert payload == live_ranks.sized(seq)
                received.append(seq)
    assert received == list(range(iterations))


@pytest.mark.parametrize("iterations", [STORM, STORM_SLOW])
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
@pytest.mark.both_loops
async def test_a_call_storm_never_answers_a_call_with_another_calls_reply(
    anyio_backend: str, kind: str, iterations: int
) -> None:
    fn, options = kind_of(kind, "serve")
    answered = [0, 0]
    async with group(fn, seconds=120, what="a call storm", **options) as ctx:
        await ctx.wait_ready()
        # Deadlines up to twice a call's time here and now: cancellations land
        # all along a call, and some calls finish, however loaded the machine.
        timed = []
        for _ in range(5):
            began = anyio.current_time()
            await ctx.call("add", 0)
            timed.append(anyio.current_time() - began)
        longest = 2 * sorted(timed)[2]

        async def storm(caller: int) -> None:
            # Two callers at once, each its own numbers: a reply to the wrong
            # call shows as a wrong sum.
            base = caller * 1_000_000
            for seq, deadline in enumerate(deadlines(iterations + caller, iterations, longest)):
                with anyio.move_on_after(deadline):
                    if seq % 2:
                        answer = await ctx.call("add", base + seq, b=1)
                    else:  # ended by the call's own timeout instead
                        try:
                            answer = await ctx.call("add", base + seq, b=1, timeout=deadline)
                        except TimeoutError:
                            continue
                    assert answer == [(0, base + seq + 1), (1, base + seq + 1)]
                    answered[caller] += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(storm, 0)
            tg.start_soon(storm, 1)
        assert await ctx.call("add", -1) == [(0, -1), (1, -1)]
    assert ctx.results == ["served", "served"]
    assert all(answered), f"every call was cancelled, {answered}: the storm tested nothing"


@pytest.mark.parametrize("iterations", [STORM, STORM_SLOW])
@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_a_storm_of_cancellations_in_an_async_rank_loses_nothing(
    anyio_backend: str, rank_loop: str, iterations: int
) -> None:
    async with group(
        live_ranks.storm_in_rank_async,
        iterations,
        nprocs=1,
        seconds=120,
        rank_loop=rank_loop,
        what="a storm in the rank",
    ) as ctx:
        channel = ctx.channel(0)
        for seq in range(iterations):
            await channel.send(seq)
        assert await channel.receive() == ("received", list(range(iterations)))
        delivered = []
        while (message := await channel.receive())[0] != "sent":
            seq, payload = message
            assert len(payload) == seq % 5 * 50_000
            delivered.append(seq)
        completed = message[1]
    assert delivered == sorted(set(delivered))
    assert set(completed) <= set(delivered)
    assert completed, "every send was cancelled: the storm tested nothing"


# ----------------------------------------------------------- collective calls


@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_an_async_rank_serves_calls_while_another_task_sends(
    anyio_backend: str, rank_loop: str
) -> None:
    # The rank's sender and its serve() replies both wait for a full socket.
    async with group(
        live_ranks.serve_while_sending_async,
        200,
        nprocs=1,
        rank_loop=rank_loop,
        seconds=30,
        what="calls while the rank streams messages",
    ) as ctx:
        channel = ctx.channel(0)
        received = []

        async def calls() -> None:
            for seq in range(30):
                assert await ctx.call("add", seq) == [(0, seq)]

        async def receive_all() -> None:
            while (message := await channel.receive())[0] != "done":
                received.append(message[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(calls)
            # The supervisor's inbox fills and it stops reading: the rank's
            # socket fills, with a reply queued behind its messages.
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(receive_all)
    assert received == list(range(200))


@pytest.mark.parametrize("kind", ["sync", "asyncio", "trio"])
@pytest.mark.both_loops
async def test_call_returns_the_results_in_rank_order(anyio_backend: str, kind: str) -> None:
    fn, options = kind_of(kind, "serve")
    async with group(fn, nprocs=3, what="ctx.call()", **options) as ctx:
        await ctx.wait_ready()
        assert await ctx.call("whoami") == [0, 1, 2]
        assert await ctx.call("add", 2, b=3) == [(0, 5), (1, 5), (2, 5)]
        assert await ctx.call("whoami", ranks=[2, 0]) == [2, 0]
        assert await ctx.call("whoami", ranks=[]) == []
    assert ctx.results == ["served"] * 3


@pytest.mark.parametrize("kind", ["sync", "asyncio", "trio"])
async def test_a_handler_error_is_raised_as_itself_and_the_group_goes_on(
    anyio_backend: str, kind: str
) -> None:
    fn, options = kind_of(kind, "serve")
    async with group(fn, nprocs=3, what="a call whose handler raised", **options) as ctx:
        await ctx.wait_ready()
        with pytest.raises(live_ranks.RankError, match="handler failed on rank 1") as info:
            await ctx.call("fail", [2, 1])
        notes = "\n".join(info.value.__notes__)
        assert "raised by rank 1's handler in ctx.call('fail')" in notes
        assert "ranks 2 raised too" in notes
        assert "Traceback" in notes
        with pytest.raises(AttributeError, match="public methods only"):
            await ctx.call("_private")
        assert await ctx.call("fail", []) == [0, 1, 2]
    assert ctx.results == ["served"] * 3


async def test_call_results_and_errors_that_do_not_pickle_plainly(anyio_backend: str) -> None:
    async with group(live_ranks.serve, what="calls with awkward values") as ctx:
        await ctx.wait_ready()
        # Above the size decoded on a worker thread.
        assert await ctx.call("blob", 1 << 20) == [b"\0" * (1 << 20), b"\1" * (1 << 20)]
        with pytest.raises(TypeError, match="the handler's return value cannot be pickled"):
            await ctx.call("unpicklable")
        with pytest.raises(aiospawn.RemoteTraceback) as info:
            await ctx.call("raise_unpicklable")
        assert "the handler's own error on rank 0" in str(info.value)
        with pytest.raises(AttributeError, match="no_such_method"):
            await ctx.call("no_such_method")
        with pytest.raises(TypeError, match=r"Handler\.awaited is an async def method"):
            await ctx.call("awaited")
        with pytest.raises(TypeError):
            await ctx.call("add", lambda: None)
        with pytest.raises(ValueError, match="rank 2"):
            await ctx.call("whoami", ranks=[2])
        assert await ctx.call("whoami") == [0, 1]
    assert ctx.results == ["served", "served"]


async def test_a_call_to_several_ranks_holds_one_copy_of_a_large_argument(
    anyio_backend: str,
) -> None:
    # bytes travel in the pickle (they cannot go out of band), so a call's
    # request is as large as its argument. Each rank's frame is the call's
    # id, then that request as it is: three ranks cost one pickle of the
    # argument, where joining the id to it would cost one copy per rank more.
    size = 16 << 20
    data = os.urandom(size - 1) + b"\7"
    async with group(live_ranks.serve, nprocs=3, what="a call with 16 MiB of bytes") as ctx:
        await ctx.wait_ready()
        tracemalloc.start()
        try:
            assert await ctx.call("length", data) == [(size, 7)] * 3
            held = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert size <= held < 2 * size, f"{held / size:.2f} times the argument"


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_a_rank_that_dies_during_a_call_raises_its_failure(
    anyio_backend: str, kind: str
) -> None:
    fn, options = kind_of(kind, "serve")
    ctx = await aiospawn.start_processes(fn, nprocs=2, join=False, start_method="fork", **options)
    with tripwire(60, "a call to a dying rank"):
        await ctx.wait_ready()
        with pytest.raises(ProcessExitedException) as info:
            await ctx.call("die", 1)
        with pytest.raises(ProcessExitedException) as joined:
            await ctx.join()
    assert info.value.error_index == 1
    assert info.value.exit_code == 9
    assert joined.value.error_index == 1


@pytest.mark.both_loops
async def test_a_call_times_out_naming_the_silent_rank_and_its_late_reply_is_dropped(
    anyio_backend: str,
) -> None:
    hold_reader, hold_writer = multiprocessing.Pipe(duplex=False)
    with hold_reader, hold_writer:
        async with group(live_ranks.serve, hold_reader, what="a call that times out") as ctx:
            await ctx.wait_ready()
            with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not answer within 0.5 s"):
                await ctx.call("hold", 1, timeout=0.5)
            hold_writer.send("answer now")  # the late reply (1) comes before the next one
            assert await ctx.call("add", 10, b=20) == [(0, 30), (1, 30)]
            assert await ctx.call("whoami", ranks=[1]) == [1]
    assert ctx.results == ["served", "served"]


# ------------------------------------------- calls that overlap and are cancelled


@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
@pytest.mark.both_loops
async def test_an_async_rank_runs_calls_at_once(anyio_backend: str, rank_loop: str) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        async with group(
            live_ranks.serve_overlapping_async,
            writer,
            None,
            rank_loop=rank_loop,
            what="three calls that return only once all three run (one at a time never do)",
        ) as ctx:
            await ctx.wait_ready()
            answers: list[list[int]] = []

            async def meet() -> None:
                answers.append(await ctx.call("meet", 3))

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(meet)
    assert answers == [[0, 1]] * 3
    assert ctx.results == ["served", "served"]


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.parametrize("limit", [None, 1])
@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_a_call_given_up_cancels_its_handler_and_frees_the_rank(
    anyio_backend: str, rank_loop: str, limit: int | None, how: str
) -> None:
    # With limit=1 the rank runs one call at a time: the next call is
    # answered only once the abandoned one's task has ended.
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        async with group(
            live_ranks.serve_overlapping_async,
            writer,
            limit,
            nprocs=1,
            rank_loop=rank_loop,
            what="a rank whose abandoned call was not cancelled",
        ) as ctx:
            await ctx.wait_ready()
            if how == "timeout":
                with pytest.raises(TimeoutError, match=r"rank\(s\) 0 did not answer"):
                    await ctx.call("hang", "first", timeout=0.5)
                assert await receive(reader, "start report") == ("started", "first", 0)
            else:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ctx.call, "hang", "first")
                    assert await receive(reader, "start report") == ("started", "first", 0)
                    tg.cancel_scope.cancel()
            assert await receive(reader, "cleanup report") == ("cleaned up", "first", 0)
            assert await ctx.call("whoami") == [0]
        assert not reader.poll(0)
    assert ctx.results == ["served"]


@pytest.mark.both_loops
async def test_a_sync_rank_runs_a_handler_given_up_to_its_end_and_drops_calls_not_started(
    anyio_backend: str,
) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    release_reader, release_writer = multiprocessing.Pipe(duplex=False)
    with reader, writer, release_reader, release_writer:
        async with group(
            live_ranks.serve_holding,
            writer,
            release_reader,
            nprocs=1,
            what="a sync rank holding a call",
        ) as ctx:
            await ctx.wait_ready()
            with pytest.raises(TimeoutError):
                await ctx.call("hold", "first", timeout=0.5)
            assert await receive(reader, "start report") == ("started", "first")
            # A second call, given up while the first still holds the rank.
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctx.call, "record", "second")
                await anyio.wait_all_tasks_blocked()  # its CALL is written
                tg.cancel_scope.cancel()
            release_writer.send("go")
            assert await receive(reader, "end report") == ("ran to its end", "first")
            # The first call's answer was dropped; the second never ran.
            assert await ctx.call("record", "third") == [["third"]]
    assert ctx.results == ["served"]
