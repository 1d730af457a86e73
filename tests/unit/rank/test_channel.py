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
from aiospawn._rank.frames import Frames, open_channel
from aiospawn._rank.reader import FrameReader
from aiospawn._rank.wire import CALL_ID, FROM_RANK, Link, header
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
def pair() -> Iterator[tuple[socket.socket, Frames]]:
    ours, theirs = socket.socketpair()
    frames = open_channel(theirs.detach())
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
    pair: tuple[socket.socket, Frames],
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
    anyio_backend: str, pair: tuple[socket.socket, Frames]
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
    anyio_backend: str, pair: tuple[socket.socket, Frames]
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
    assert CALL_ID.unpack(reply.prefix) == (7,)
    ok, raised = pickle.loads(reply.body)
    assert not ok
    _, type_name, text = pickle.loads(raised)
    assert type_name == "builtins.ValueError"
    assert "the handler's return value cannot be sent" in text


def test_a_rank_reads_nothing_past_a_bad_frame_from_the_supervisor(
    pair: tuple[socket.socket, Frames],
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


# ----------------------------------------------------- calls in an async rank


class Overlapping:
    """Methods that show whether calls overlap, and whether they were cancelled."""

    def __init__(self, meeting: int) -> None:
        self.meeting = meeting
        self.arrived = 0
        self.everyone = anyio.Event()
        self.log: list[str] = []

    async def meet(self, name: str) -> str:
        """Return once ``meeting`` calls are here: only calls that overlap get past."""
        self.arrived += 1
        if self.arrived == self.meeting:
            self.everyone.set()
        await self.everyone.wait()
        return name

    async def hang(self, name: str) -> None:
        try:
            self.log.append(f"{name} started")
            await anyio.sleep_forever()
        finally:
            self.log.append(f"{name} cleaned up")

    def record(self, name: str) -> str:
        self.log.append(name)
        return name

    async def exit(self) -> None:
        await anyio.lowlevel.checkpoint()
        raise SystemExit(3)


def cancel(sock: socket.socket, call_id: int) -> None:
    send(sock, Link.CANCEL, CALL_ID.pack(call_id))


def answers(sock: socket.socket, count: int) -> dict[int, object]:
    """``call_id: value`` of ``count`` REPLY frames, each a value (not an error)."""
    replies = read_replies(sock, count)
    assert all(ok for ok, _ in replies.values()), replies
    return {call_id: value for call_id, (_, value) in replies.items()}


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_an_async_rank_runs_each_call_in_a_task_of_its_own(
    anyio_backend: str, pair: tuple[socket.socket, Frames]
) -> None:
    sock, frames = pair
    for call_id in (1, 2, 3):
        call(sock, call_id, "meet", f"caller {call_id}")
    send(sock, Link.CLOSE, b"")
    with anyio.fail_after(10):  # one call at a time would wait forever for the others
        await AsyncChannel(frames, anyio_backend).serve(Overlapping(meeting=3))
    assert answers(sock, 3) == {1: "caller 1", 2: "caller 2", 3: "caller 3"}


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_a_cancel_ends_the_handler_of_its_call_and_the_others_answer(
    anyio_backend: str, pair: tuple[socket.socket, Frames]
) -> None:
    sock, frames = pair
    handler = Overlapping(meeting=1)
    channel = AsyncChannel(frames, anyio_backend)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.serve, handler)
            call(sock, 1, "hang", "one")
            call(sock, 2, "record", "two")
            await anyio.wait_all_tasks_blocked()
            assert sorted(handler.log) == ["one started", "two"]
            cancel(sock, 1)
            cancel(sock, 2)  # answered already: nothing to stop
            cancel(sock, 99)  # never called
            call(sock, 3, "record", "three")
            send(sock, Link.CLOSE, b"")
    assert sorted(handler.log[2:]) == ["one cleaned up", "three"]
    assert answers(sock, 2) == {2: "two", 3: "three"}  # and nothing for the cancelled call
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(1)


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_a_limit_holds_calls_back_and_a_cancel_drops_a_waiting_one_unrun(
    anyio_backend: str, pair: tuple[socket.socket, Frames]
) -> None:
    sock, frames = pair
    handler = Overlapping(meeting=1)
    channel = AsyncChannel(frames, anyio_backend)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: channel.serve(handler, limit=1))
            call(sock, 1, "hang", "one")
            call(sock, 2, "record", "two")
            call(sock, 3, "record", "three")
            call(sock, 4, "record", "four")
            await anyio.wait_all_tasks_blocked()
            assert handler.log == ["one started"]  # the others wait their turn
            cancel(sock, 2)
            cancel(sock, 1)
            send(sock, Link.CLOSE, b"")
    assert handler.log == ["one started", "one cleaned up", "three", "four"]
    assert answers(sock, 2) == {3: "three", 4: "four"}


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_a_handler_that_raises_system_exit_ends_serve_and_cancels_the_others(
    anyio_backend: str, pair: tuple[socket.socket, Frames]
) -> None:
    sock, frames = pair
    handler = Overlapping(meeting=1)
    call(sock, 1, "hang", "one")
    call(sock, 2, "exit")
    with anyio.fail_after(10), pytest.raises(SystemExit) as info:
        await AsyncChannel(frames, anyio_backend).serve(handler)
    assert info.value.code == 3
    assert handler.log == ["one started", "one cleaned up"]


@pytest.mark.both_loops
@pytest.mark.anyio
async def test_cancelling_serve_cancels_every_call_under_way(
    anyio_backend: str, pair: tuple[socket.socket, Frames]
) -> None:
    sock, frames = pair
    handler = Overlapping(meeting=1)
    call(sock, 1, "hang", "one")
    call(sock, 2, "hang", "two")
    with anyio.fail_after(10), anyio.move_on_after(0.2) as scope:  # the rank's SIGTERM
        await AsyncChannel(frames, anyio_backend).serve(handler)
    assert scope.cancelled_caught
    assert sorted(handler.log) == ["one cleaned up", "one started", "two cleaned up", "two started"]


def test_a_blocking_channel_drops_a_call_cancelled_before_it_starts(
    pair: tuple[socket.socket, Frames],
) -> None:
    sock, frames = pair
    log: list[str] = []

    class Blocking:
        def first(self) -> str:
            # The supervisor gives up on this call and the next while it runs.
            cancel(sock, 1)
            cancel(sock, 2)
            call(sock, 3, "record", "three")
            send(sock, Link.CLOSE, b"")
            log.append("first ran to its end")
            return "first"

        def record(self, name: str) -> str:
            log.append(name)
            return name

    call(sock, 1, "first")
    call(sock, 2, "record", "two")
    call(sock, 4, "record", "four")
    cancel(sock, 4)  # read with its call: dropped at once
    rank_channel.Channel(frames).serve(Blocking(), limit=5)  # one at a time whatever the limit
    assert log == ["first ran to its end", "three"]
    assert answers(sock, 2) == {1: "first", 3: "three"}


@pytest.mark.parametrize(
    ("limit", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError)]
)
def test_serve_refuses_a_limit_that_is_not_a_positive_int(
    pair: tuple[socket.socket, Frames], limit: object, error: type[Exception]
) -> None:
    _, frames = pair
    with pytest.raises(error, match="limit must be a positive int or None"):
        rank_channel.Channel(frames).serve(Overlapping(1), limit=limit)  # type: ignore[arg-type]
