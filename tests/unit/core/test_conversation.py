"""Channels, readiness and calls on the fake backend: the supervisor's policy, no process.

Each fake rank has a channel in memory (``tests/fake_backend.MemoryLink``)
whose rank's end the test plays with the rank side's own encodings; the
group's channel code (``aiospawn._core._conversation``, with its
``_inbound`` and ``_outbound``, behind ``_channel.RankChannel``) runs as it
does for real ranks. What only real ranks and sockets show (a rank's own channel API,
start methods, rank loops, large payloads) is tested in tests/test_live.py.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

import aiospawn
from aiospawn._core import _pickles
from aiospawn._core._inbound import INBOX_MESSAGES
from aiospawn._core._outbound import QUEUED_BYTES
from aiospawn._rank.wire import Link as Frame
from tests.fake_backend import FakeBackend, MemoryLink, start_group
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def fake_group(
    nprocs: int = 2,
) -> AsyncIterator[tuple[aiospawn.AsyncProcessContext[Any], FakeBackend]]:
    """A supervised group of fake ranks with channels; each rank returns at the end."""
    backend = FakeBackend(links=True)
    ctx = await start_group(backend, nprocs=nprocs)
    with tripwire(10, "a fake group's channel test"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervise, ctx)
            yield ctx, backend
            for rank in range(nprocs):
                if backend.attempt(rank).exit is None:
                    backend.attempt(rank).returns()


async def supervise(ctx: aiospawn.AsyncProcessContext[Any]) -> None:
    """Run the group's supervision, as a block does; the test looks at how it ended."""
    with contextlib.suppress(aiospawn.ProcessException):
        await ctx.join()


def link(backend: FakeBackend, rank: int) -> MemoryLink:
    found = backend.attempt(rank).link
    assert isinstance(found, MemoryLink)
    return found


async def test_wait_ready_returns_the_payloads_in_rank_order_whatever_order_they_came_in() -> None:
    async with fake_group(3) as (ctx, backend):
        for rank in (2, 0, 1):
            link(backend, rank).ready({"rank": rank})
        assert await ctx.wait_ready() == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


async def test_wait_ready_fails_with_the_failure_of_a_rank_that_ends_unready() -> None:
    async with fake_group(2) as (ctx, backend):
        link(backend, 0).ready()
        backend.attempt(1).raises(ValueError("no model"))
        with pytest.raises(aiospawn.ProcessRaisedException) as caught:
            await ctx.wait_ready()
    assert caught.value.error_index == 1


async def test_messages_come_in_order_and_the_end_of_the_rank_ends_the_stream() -> None:
    async with fake_group(1) as (ctx, backend):
        channel = ctx.channel(0)
        await channel.send("ping")
        [(kind, payload)] = link(backend, 0).read()
        assert (kind, pickle.loads(payload)) == (Frame.MESSAGE, "ping")
        for item in ("a", "b", "c"):
            link(backend, 0).message(item)
        assert [await channel.receive() for _ in range(3)] == ["a", "b", "c"]
        link(backend, 0).end()
        backend.attempt(0).returns()
        with pytest.raises(anyio.EndOfStream):
            await channel.receive()


async def test_a_full_inbox_stops_reading_until_a_receive_takes_a_message() -> None:
    async with fake_group(1) as (ctx, backend):
        rank = link(backend, 0)
        for seq in range(INBOX_MESSAGES + 5):
            rank.message(seq)
        channel = ctx.channel(0)
        # Once the inbox holds INBOX_MESSAGES, nothing more is read: the rest
        # stays with the rank (its socket would fill, and its send() block).
        await anyio.wait_all_tasks_blocked()
        left = rank.unsent
        assert left > 0
        assert await channel.receive() == 0
        await anyio.wait_all_tasks_blocked()
        assert rank.unsent < left
        assert [await channel.receive() for _ in range(INBOX_MESSAGES + 4)] == list(
            range(1, INBOX_MESSAGES + 5)
        )


async def test_a_send_waits_while_the_rank_reads_nothing_and_goes_once_it_reads() -> None:
    async with fake_group(1) as (ctx, backend):
        rank = link(backend, 0)
        rank.window = 1024
        channel = ctx.channel(0)
        sent: list[int] = []

        async def send_many() -> None:
            for seq in range(10):
                await channel.send(b"x" * 600 + bytes([seq]))
                sent.append(seq)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_many)
            await anyio.wait_all_tasks_blocked()
            assert len(sent) < 10  # held back by the rank's full window
            received: list[bytes] = []
            while len(received) < 10:
                received += [pickle.loads(payload) for _, payload in rank.read()]
                await anyio.wait_all_tasks_blocked()
        assert [item[-1] for item in received] == list(range(10))


async def test_a_message_that_cannot_be_unpickled_raises_once_and_the_next_one_follows() -> None:
    async with fake_group(1) as (ctx, backend):
        link(backend, 0).send(Frame.MESSAGE, b"not a pickle")
        link(backend, 0).message("after")
        channel = ctx.channel(0)
        with pytest.raises(pickle.UnpicklingError):
            await channel.receive()
        assert await channel.receive() == "after"


async def test_a_call_goes_to_every_rank_and_its_answers_come_back_in_rank_order() -> None:
    async with fake_group(3) as (ctx, backend):
        async with anyio.create_task_group() as tg:
            answers: list[Any] = []

            async def call() -> None:
                answers.extend(await ctx.call("predict", 1.5, scale=2))

            tg.start_soon(call)
            await anyio.wait_all_tasks_blocked()
            requests = {rank: link(backend, rank).calls() for rank in range(3)}
            for rank in (2, 0, 1):  # answered out of order
                [(call_id, method, args, kwargs)] = requests[rank]
                assert (method, args, kwargs) == ("predict", (1.5,), {"scale": 2})
                link(backend, rank).reply(call_id, rank * 10)
        assert answers == [0, 10, 20]


async def test_a_handler_error_comes_back_as_itself_naming_the_rank() -> None:
    async with fake_group(2) as (ctx, backend):
        async with anyio.create_task_group() as tg:

            async def answer() -> None:
                await anyio.wait_all_tasks_blocked()
                for rank in (0, 1):
                    [(call_id, *_)] = link(backend, rank).calls()
                    error = KeyError("no such key") if rank == 1 else None
                    link(backend, rank).reply(call_id, "ok", error=error)

            tg.start_soon(answer)
            with pytest.raises(KeyError) as caught:
                await ctx.call("lookup")
        assert "rank 1" in "".join(getattr(caught.value, "__notes__", []))
        # The group goes on: the ranks were not stopped for a handler's error.
        assert backend.attempt(0).signals == backend.attempt(1).signals == []


async def test_a_timed_out_call_names_the_silent_rank_and_its_late_answer_is_dropped() -> None:
    async with fake_group(2) as (ctx, backend):
        async with anyio.create_task_group() as tg:

            async def answer_rank_0_only() -> None:
                await anyio.wait_all_tasks_blocked()
                [(call_id, *_)] = link(backend, 0).calls()
                link(backend, 0).reply(call_id, "first")

            tg.start_soon(answer_rank_0_only)
            with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not answer"):
                await ctx.call("slow", timeout=0.2)
        [(late_id, *_)] = link(backend, 1).calls()
        async with anyio.create_task_group() as tg:

            async def answer_both() -> None:
                await anyio.wait_all_tasks_blocked()
                # The timed-out call's answer comes while the next call waits.
                link(backend, 1).reply(late_id, "late")
                for rank in (0, 1):
                    [(call_id, *_)] = link(backend, rank).calls()
                    assert call_id != late_id
                    link(backend, rank).reply(call_id, f"second {rank}")

            tg.start_soon(answer_both)
            assert await ctx.call("next") == ["second 0", "second 1"]
        # The silent rank was told to stop the handler; rank 0 had answered.
        assert (link(backend, 0).cancelled, link(backend, 1).cancelled) == ([], [late_id])


async def test_a_cancelled_call_tells_each_rank_that_has_not_answered_to_cancel_it() -> None:
    async with fake_group(3) as (ctx, backend):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def answer_rank_1_then_cancel() -> None:
                    await anyio.wait_all_tasks_blocked()
                    [(call_id, *_)] = link(backend, 1).calls()
                    link(backend, 1).reply(call_id, "answered")
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()

                tg.start_soon(answer_rank_1_then_cancel)
                await ctx.call("long")
        await anyio.wait_all_tasks_blocked()
        cancelled = {}
        for rank in (0, 2):
            [(call_id, *_)] = link(backend, rank).calls()  # the CALL, then its CANCEL
            cancelled[rank] = (call_id, link(backend, rank).cancelled)
        assert cancelled == {0: (call_id, [call_id]), 2: (call_id, [call_id])}
        assert link(backend, 1).calls() == []
        assert link(backend, 1).cancelled == []  # it answered: nothing to stop


async def test_a_call_cancelled_before_it_was_queued_sends_neither_call_nor_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every message pickled on the loop: one pickled on a worker thread would
    # count as blocked, and be cancelled before it is queued (seen on trio).
    monkeypatch.setattr(_pickles, "THREAD_BYTES", 1 << 30)
    monkeypatch.setattr(_pickles, "ENCODE_BYTES", 1 << 30)
    monkeypatch.setattr(_pickles, "ENCODE_SECONDS", math.inf)
    async with fake_group(1) as (ctx, backend):
        rank = link(backend, 0)
        rank.window = 1024
        channel = ctx.channel(0)
        await channel.send(b"x" * 2000)  # fills the rank's window: it does not read

        async def queue_a_message() -> None:  # queued whole, it waits to be written
            # More than the queue's bound even after the writer fills the
            # rank's window with its start: the call cannot queue behind it.
            await channel.send(b"y" * (QUEUED_BYTES + 4 * rank.window))

        async def call() -> None:  # waits for room to queue its CALL
            await ctx.call("never")

        for step in (queue_a_message, call):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
        kinds = []
        while frames := rank.read():
            kinds += [kind for kind, _ in frames]
            await anyio.wait_all_tasks_blocked()
        assert kinds == [Frame.MESSAGE, Frame.MESSAGE]


async def test_a_rank_that_dies_during_a_call_raises_its_failure_and_the_others_cancel() -> None:
    async with fake_group(2) as (ctx, backend):
        async with anyio.create_task_group() as tg:

            async def die() -> None:
                await anyio.wait_all_tasks_blocked()
                link(backend, 1).end()
                backend.attempt(1).exits(-9)

            tg.start_soon(die)
            with pytest.raises(aiospawn.ProcessExitedException, match="SIGKILL"):
                await ctx.call("anything")
        await anyio.wait_all_tasks_blocked()
        [(call_id, *_)] = link(backend, 0).calls()
        assert link(backend, 0).cancelled == [call_id]  # the call has failed: rank 0 stops


async def test_a_rank_named_twice_is_refused_before_any_call_is_sent() -> None:
    async with fake_group(2) as (ctx, backend):
        with pytest.raises(ValueError, match="more than once"):
            await ctx.call("count", ranks=[0, 0, 1])
        assert link(backend, 0).read() == link(backend, 1).read() == []
