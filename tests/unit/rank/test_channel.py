"""A rank's end of its channel (``_rank.channel``, ``_rank.async_channel``) over a socket pair.

The test plays the supervisor on the other end of the pair. Blocking and
awaited ends take their frames through the same ``Frames``: frames of the
kind a call does not wait for are kept, in order, for the next call that
does.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest

from aiospawn._rank import channel as rank_channel
from aiospawn._rank import wire
from aiospawn._rank.async_channel import AsyncChannel
from aiospawn._rank.wire import CALL_ID, FROM_RANK, FrameReader, Link, header
from tests.helpers import first_frame


class Handler:
    def double(self, x: int) -> int:
        return 2 * x

    async def later(self, x: int) -> int:
        await anyio.lowlevel.checkpoint()
        return x + 1

    def fails(self) -> None:
        raise LookupError("not here")

    async def fails_later(self) -> None:
        await anyio.lowlevel.checkpoint()
        raise LookupError("not there")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, rank_channel.Frames]]:
    ours, theirs = socket.socketpair()
    frames = rank_channel.open_channel(theirs.detach())
    with ours:
        yield ours, frames
    frames.close()


def send(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(header(kind, len(payload)) + payload)


def call(sock: socket.socket, call_id: int, method: str, *args: object) -> None:
    send(sock, Link.CALL, CALL_ID.pack(call_id) + pickle.dumps((method, args, {})))


def read_replies(sock: socket.socket, count: int) -> dict[int, tuple[bool, object]]:
    """``call_id: (ok, value or (type name, traceback text))`` of ``count`` REPLY frames."""
    replies: dict[int, tuple[bool, object]] = {}
    while len(replies) < count:
        reader = FrameReader(FROM_RANK)
        while (frame := reader.frame()) is None:
            reader.feed(sock.recv(reader.wanted))
        kind, payload = frame
        assert kind == Link.REPLY
        (call_id,) = CALL_ID.unpack_from(payload)
        ok, value = pickle.loads(payload[CALL_ID.size :])
        if not ok:
            _, type_name, text = pickle.loads(value)
            value = (type_name, text)
        replies[call_id] = (ok, value)
    return replies


def supervisor_sends_a_call_a_message_then_closes(sock: socket.socket) -> None:
    call(sock, 1, "double", 21)
    send(sock, Link.MESSAGE, pickle.dumps("hello"))
    call(sock, 2, "fails")
    call(sock, 3, "_private")
    send(sock, Link.CLOSE, b"")


def test_a_blocking_channel_keeps_each_kind_for_the_call_that_waits_for_it(
    pair: tuple[socket.socket, rank_channel.Frames],
) -> None:
    sock, frames = pair
    supervisor_sends_a_call_a_message_then_closes(sock)
    channel = rank_channel.Channel(frames)
    assert channel.receive() == "hello"  # read past the call, which is kept
    channel.serve(Handler())  # answers the calls kept, returns at the close
    replies = read_replies(sock, 3)
    assert replies[1] == (True, 42)
    ok, (type_name, text) = replies[2]  # type: ignore[misc]
    assert (ok, type_name) == (False, "builtins.LookupError")
    assert first_frame(text).endswith(", in fails")  # starts in the handler, not in serve
    assert replies[3][0] is False
    with pytest.raises(EOFError):
        channel.receive()


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_an_awaited_channel_keeps_each_kind_for_the_call_that_waits_for_it(
    anyio_backend: str, pair: tuple[socket.socket, rank_channel.Frames]
) -> None:
    sock, frames = pair
    call(sock, 4, "later", 1)
    call(sock, 5, "fails_later")
    supervisor_sends_a_call_a_message_then_closes(sock)
    channel = AsyncChannel(frames, anyio_backend)
    assert await channel.receive() == "hello"
    await channel.serve(Handler())
    replies = read_replies(sock, 5)
    assert replies[1] == (True, 42)
    assert replies[4] == (True, 2)
    for call_id, where in ((2, "fails"), (5, "fails_later")):
        ok, (type_name, text) = replies[call_id]  # type: ignore[misc]
        assert (ok, type_name) == (False, "builtins.LookupError")
        assert first_frame(text).endswith(f", in {where}")
    assert replies[3][0] is False
    with pytest.raises(EOFError):
        await channel.receive()


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_an_awaited_receive_waits_for_the_message_to_arrive(
    anyio_backend: str, pair: tuple[socket.socket, rank_channel.Frames]
) -> None:
    sock, frames = pair
    channel = AsyncChannel(frames, anyio_backend)
    received: list[object] = []
    async with anyio.create_task_group() as tg:

        async def receive() -> None:
            received.append(await channel.receive())

        tg.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        assert received == []  # waiting on the socket, not spinning
        send(sock, Link.MESSAGE, pickle.dumps("late"))
    assert received == ["late"]


def test_a_rank_refuses_to_send_or_answer_with_a_pickle_beyond_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 1000)
    with pytest.raises(ValueError, match=r"more than a channel frame carries \(1000"):
        rank_channel.encode(b"x" * 1000)
    reply = rank_channel.reply(7, True, b"x" * 1000)
    assert CALL_ID.unpack_from(reply) == (7,)
    ok, raised = pickle.loads(reply[CALL_ID.size :])
    assert not ok
    _, type_name, text = pickle.loads(raised)
    assert type_name == "builtins.ValueError"
    assert "the handler's return value cannot be sent" in text


def test_a_rank_reads_nothing_past_a_bad_frame_from_the_supervisor(
    pair: tuple[socket.socket, rank_channel.Frames],
) -> None:
    sock, frames = pair
    one = pickle.dumps(1)
    sock.sendall(header(Link.MESSAGE, len(one)) + one)
    sock.sendall(header(Link.REPLY, 8) + bytes(8))  # only ranks reply
    sock.sendall(header(Link.MESSAGE, 1) + b"N")
    channel = rank_channel.Channel(frames)
    assert channel.receive() == 1
    for _ in range(2):
        with pytest.raises(ConnectionError, match="supervisor sent a frame of unknown kind 4"):
            channel.receive()
