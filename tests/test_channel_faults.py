"""What a rank channel does with data it cannot carry: bad frames, pickles that raise, repeats.

A frame whose header breaks the format fails its rank (stopped, reported as
that rank's failure, in bounded memory); a message, ready payload, call
argument or answer whose pickling or unpickling raises, ``SystemExit`` and
``KeyboardInterrupt`` included, is that one object's error, and the channel
and the ranks go on. Rank functions: ``tests/hostile_ranks.py``.
"""

from __future__ import annotations

import pickle

import anyio
import psutil
import pytest

import aiospawn
from aiospawn import ProcessException
from aiospawn._core import _pickles
from aiospawn._rank import wire
from aiospawn._rank.wire import CALL_ID, MAX_FRAME_BYTES, Link, header
from tests import hostile_ranks
from tests.test_live import KINDS, group

pytestmark = pytest.mark.anyio

#: What unpickling a ``hostile_ranks.Bomb`` raises, by its ``what``.
CAUSES: dict[str, type[BaseException]] = {
    "value": ValueError,
    "exit": SystemExit,
    "interrupt": KeyboardInterrupt,
}

# ------------------------------------------------------------------ bad frames

#: ``id: (bytes the rank writes to its socket, MiB of junk after them, what the error says)``
BAD_FRAMES: dict[str, tuple[bytes, int, str]] = {
    "garbage": (b"\xff" * 100, 0, "a frame of unknown kind 255 (its header: ff ff"),
    "a size of 2**62": (header(Link.MESSAGE, 2**62), 64, "more than a channel frame carries"),
    "one byte beyond the limit": (
        header(Link.MESSAGE, MAX_FRAME_BYTES + 1),
        0,
        f"a MESSAGE frame of {MAX_FRAME_BYTES + 1} bytes, more than a channel frame carries",
    ),
    "a short REPLY": (header(Link.REPLY, 2) + b"\0\1", 0, "shorter than its 8-byte call id"),
    "a CALL from a rank": (header(Link.CALL, CALL_ID.size) + bytes(8), 0, "unknown kind 3"),
    "a CLOSE with a payload": (header(Link.CLOSE, 1) + b"x", 0, "a CLOSE frame is empty"),
}


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
async def test_a_bad_frame_fails_its_rank_with_a_clear_error_in_bounded_memory(
    anyio_backend: str, frame: tuple[bytes, int, str]
) -> None:
    data, junk, says = frame
    supervisor = psutil.Process()
    before = supervisor.memory_info().rss
    with pytest.raises(ProcessException) as info:
        async with group(
            hostile_ranks.write_to_channel, 1, data, junk, seconds=30, what="a bad frame"
        ) as ctx:
            await ctx.channel(1).receive()
    grown = supervisor.memory_info().rss - before
    # The rank's failure itself, not an ExceptionGroup of the supervision's crash.
    assert type(info.value) is ProcessException
    assert info.value.error_index == 1
    assert f"process 1 (pid {info.value.error_pid}) broke its channel: it sent" in str(info.value)
    assert says in str(info.value)
    ranks = ctx.statistics().ranks
    assert all(rank.last_exit is not None and rank.last_exit.stopped_by_us for rank in ranks)
    # Nothing of the announced payload was read: not the 64 MiB of junk after it.
    assert grown < 32 << 20, f"the supervisor grew by {grown / 2**20:.0f} MiB"


async def test_a_bad_frame_read_by_a_receive_outside_supervision_fails_the_rank(
    anyio_backend: str,
) -> None:
    """No ``async with`` and nobody joining: the ``receive()`` that reads it raises at once."""
    ctx = await aiospawn.start_processes(
        hostile_ranks.write_to_channel,
        (1, b"\xff" * 100, 0),
        nprocs=2,
        join=False,
        start_method="fork",
    )
    with anyio.fail_after(30):
        with pytest.raises(ProcessException, match="unknown kind 255") as received:
            await ctx.channel(1).receive()
        with pytest.raises(ProcessException, match="unknown kind 255") as joined:
            await ctx.join()
    assert received.value.error_index == joined.value.error_index == 1
    assert str(received.value) == str(joined.value)
    with pytest.raises(ProcessException, match="unknown kind 255"):
        await ctx.channel(1).send("too late")


async def test_a_rank_that_broke_its_channel_is_restarted_by_the_policy(anyio_backend: str) -> None:
    async with group(
        hostile_ranks.write_to_channel,
        1,
        header(Link.REPLY, 2) + b"\0\1",
        0,
        restart=aiospawn.RestartPolicy(max_restarts=1, backoff=aiospawn.Backoff(initial=0.0)),
        what="a restart after a broken channel",
    ) as ctx:
        await ctx.wait_ready()
    assert ctx.results == [None, None]
    statistics = ctx.statistics()
    assert statistics.restarts == statistics.ranks[1].restarts == 1


# ------------------------------------------------- messages and ready payloads


@pytest.mark.parametrize("what", CAUSES)
@pytest.mark.parametrize("pad", [0, 1 << 20], ids=["on the loop", "on a worker thread"])
async def test_a_message_that_cannot_be_unpickled_is_reported_once_and_the_next_one_follows(
    anyio_backend: str, what: str, pad: int
) -> None:
    async with group(hostile_ranks.send_bomb_then_more, what, pad, nprocs=1) as ctx:
        channel = ctx.channel(0)
        with pytest.raises(
            pickle.UnpicklingError, match="rank 0's message cannot be unpickled here"
        ) as info:
            await channel.receive()
        assert type(info.value.__cause__) is CAUSES[what]
        assert await channel.receive() == "after"
        with pytest.raises(anyio.EndOfStream):
            await channel.receive()
    assert ctx.results == [None]


@pytest.mark.parametrize("what", CAUSES)
async def test_a_ready_payload_that_cannot_be_unpickled_fails_wait_ready_not_the_supervisor(
    anyio_backend: str, what: str
) -> None:
    async with group(hostile_ranks.ready_with_bomb, what, nprocs=3) as ctx:
        with pytest.raises(
            pickle.UnpicklingError, match="rank 1's ready payload cannot be unpickled here"
        ) as info:
            await ctx.wait_ready()
        assert type(info.value.__cause__) is CAUSES[what]
    assert ctx.results == [0, 1, 2]


@pytest.mark.parametrize("what", CAUSES)
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_a_rank_refuses_what_it_cannot_pickle_or_unpickle_and_goes_on(
    anyio_backend: str, what: str, kind: str
) -> None:
    fn = hostile_ranks.receive_bombs if kind == "sync" else hostile_ranks.receive_bombs_async
    async with group(fn, what, nprocs=1, **KINDS[kind]) as ctx:
        channel = ctx.channel(0)
        cause = CAUSES[what].__name__
        assert await channel.receive() == ("send", f"TypeError, caused by {cause}")
        await channel.send(hostile_ranks.Bomb(what))
        await channel.send("after")
        assert await channel.receive() == ("undecodable", cause)
        assert await channel.receive() == ("got", "after")
    assert ctx.results == [None]


@pytest.mark.parametrize("what", ["value", "exit", "exit0", "interrupt"])
async def test_the_supervisor_refuses_to_send_what_cannot_be_pickled(
    anyio_backend: str, what: str
) -> None:
    async with group(hostile_ranks.serve_hostile, nprocs=1) as ctx:
        await ctx.wait_ready()
        with pytest.raises(TypeError, match="cannot send PickleBomb to a rank") as sent:
            await ctx.channel(0).send(hostile_ranks.PickleBomb(what))
        with pytest.raises(TypeError, match="cannot send tuple to a rank") as called:
            await ctx.call("echo", hostile_ranks.PickleBomb(what))
        for info in (sent, called):
            assert type(info.value.__cause__) is CAUSES.get(what, SystemExit)
        assert await ctx.call("whoami") == [0]
    assert ctx.results == ["served"]


# ----------------------------------------------------------------------- calls


@pytest.mark.parametrize("what", CAUSES)
async def test_an_answer_that_cannot_be_unpickled_is_that_calls_error(
    anyio_backend: str, what: str
) -> None:
    async with group(hostile_ranks.serve_hostile, nprocs=3) as ctx:
        await ctx.wait_ready()
        with pytest.raises(
            pickle.UnpicklingError,
            match=r"rank 1's answer to ctx.call\('bomb'\) cannot be unpickled here",
        ) as info:
            await ctx.call("bomb", what, 1, ranks=[2, 1, 0])
        assert type(info.value.__cause__) is CAUSES[what]
        assert await ctx.call("whoami") == [0, 1, 2]
    assert ctx.results == ["served"] * 3


@pytest.mark.parametrize("what", ["value", "exit0", "interrupt"])
@pytest.mark.parametrize("kind", ["sync", "asyncio", "trio"])
async def test_an_answer_the_rank_cannot_pickle_is_that_calls_error_and_the_rank_serves_on(
    anyio_backend: str, what: str, kind: str
) -> None:
    fn = hostile_ranks.serve_hostile if kind == "sync" else hostile_ranks.serve_hostile_async
    async with group(fn, **KINDS[kind]) as ctx:
        await ctx.wait_ready()
        with pytest.raises(TypeError, match="the handler's return value cannot be pickled"):
            await ctx.call("pickle_bomb", what)
        assert await ctx.call("whoami") == [0, 1]
    assert ctx.results == ["served", "served"]


@pytest.mark.parametrize("what", CAUSES)
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_an_argument_the_rank_cannot_unpickle_is_that_calls_error_and_the_rank_serves_on(
    anyio_backend: str, what: str, kind: str
) -> None:
    fn = hostile_ranks.serve_hostile if kind == "sync" else hostile_ranks.serve_hostile_async
    async with group(fn, **KINDS[kind]) as ctx:
        await ctx.wait_ready()
        with pytest.raises(
            pickle.UnpicklingError, match="the call's method and arguments cannot be unpickled"
        ) as info:
            await ctx.call("echo", hostile_ranks.Bomb(what))
        assert CAUSES[what].__name__ in str(info.value)
        assert "raised by rank 0's handler in ctx.call('echo')" in "\n".join(info.value.__notes__)
        assert await ctx.call("echo", "fine") == ["fine", "fine"]
    assert ctx.results == ["served", "served"]


async def test_a_rank_named_twice_in_a_call_is_refused_before_anything_is_sent(
    anyio_backend: str,
) -> None:
    async with group(hostile_ranks.serve_hostile) as ctx:
        await ctx.wait_ready()
        with pytest.raises(ValueError, match=r"rank\(s\) 0 more than once"):
            await ctx.call("count", ranks=[0, 0, 1])
        with pytest.raises(ValueError, match=r"rank\(s\) 0, 1 more than once"):
            await ctx.call("count", ranks=[1, 0, 1, 0])
        assert await ctx.call("count") == [1, 1]  # the refused calls reached no rank
    assert ctx.results == ["served", "served"]


# ------------------------------------------------------------------ the limit


async def test_the_supervisor_refuses_to_send_a_pickle_beyond_the_limit(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 100_000)
    assert len((await _pickles.encode(b"x" * 1000)).body) < 1100
    for size in (150_000, 2 << 20):  # pickled on the loop, and on a worker thread
        with pytest.raises(ValueError, match=r"more than a channel frame carries \(100000"):
            await _pickles.encode(b"x" * size)
