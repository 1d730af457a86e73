"""The supervisor's end of a rank's channel: messages, readiness and calls, on the event loop.

Each attempt at a rank has one :class:`Conversation` over one ``Link`` (the
backend's frame transport, ``_backend.Link``: a socket pair for local ranks),
and users hold its thin public handle, :class:`RankChannel`. A restarted rank
gets a new channel; the old one ends with its attempt, so nothing meant for a
dead attempt reaches its successor.

The group's owner pumps every conversation for as long as its attempt runs
(:meth:`Conversation.pump`): a reader sorts each frame the rank sends (a
message's pickle into the inbox, a reply's to its call, a READY payload to
the channel) and a writer writes what senders queued. Users' tasks only queue
frames and wait for the pump: nothing is decoded while a frame is taken, so a
task cancelled at any point loses nothing, and a frame queued by a send that
is cancelled meanwhile is still written whole. The task that wants an object
decodes it (``_pickles``: off the loop when it is large). A message that
cannot be decoded leaves the inbox with the error it raised: the next
``receive()`` gets the next message. The attempt's exit ends its channel (the
owner releases it), after the frames the rank sent before it.

A frame header that breaks the format (a kind a rank does not send, a size
out of range: ``wire.FROM_RANK``) breaks the channel: nothing more is read
from it, its users get the rank's failure, and the group fails that rank
(:class:`~._outcome.BrokenChannel`) as it fails a hung one.

Back-pressure, both ways. Incoming: the inbox holds :data:`INBOX_MESSAGES`
messages (or :data:`INBOX_BYTES`); while it is full nothing more is read, so
the rank's ``send()`` blocks once the socket is full too, and so do its
replies and READY behind those messages. Outgoing: a ``send()`` queues its
frame whole once less than :data:`QUEUED_BYTES` wait to be written.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
from collections.abc import Awaitable, Callable
from typing import Any, final

import anyio
import anyio.abc
import anyio.to_thread
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

from aiospawn._rank.buffers import TOKEN, Mapped, Packed
from aiospawn._rank.wire import CALL_ID, FrameError, Payload, call_id_of
from aiospawn._rank.wire import Link as Kind

from ._backend import Link, RankHandle
from ._concurrency import Broadcast
from ._errors import ProcessException
from ._loops import runs_asyncio
from ._outcome import BrokenChannel, RankExit
from ._pickles import decode, encode
from ._pool import PooledPacked, SegmentPool

#: Messages (and bytes of them) the supervisor holds for a rank's ``receive()``.
INBOX_MESSAGES = 64
INBOX_BYTES = 64 * 1024 * 1024
#: Bytes that may wait in the outgoing queue when a ``send()`` adds its frame.
QUEUED_BYTES = 256 * 1024

#: The frames the reader callback sorts itself (``Conversation._sort_now``).
_EAGER_KINDS = frozenset({Kind.MESSAGE, Kind.REPLY, Kind.READY})


@final
class RankChannel(anyio.abc.ObjectStream[Any]):
    """The supervisor's end of one rank's channel, from ``ctx.channel(rank)``.

    An anyio object stream: ``await send(obj)``, ``await receive()``,
    ``async for``, ``send_eof()``, ``aclose()``, ``async with``. Objects are
    pickled. The rank's end is ``aiospawn.channel()``. One channel per attempt
    at the rank: after a restart, ``ctx.channel(rank)`` is a new one.
    """

    def __init__(self, token: object, conversation: Conversation) -> None:
        if token is not _CONSTRUCT:
            raise TypeError("a RankChannel is made by ctx.channel(rank)")
        self._conversation = conversation

    @classmethod
    def _of(cls, conversation: Conversation) -> RankChannel:
        return cls(_CONSTRUCT, conversation)

    @property
    def rank(self) -> int:
        """The rank at the other end."""
        return self._conversation.rank

    @property
    def ready(self) -> bool:
        """True once the supervisor has seen the rank's ``aiospawn.ready()``."""
        return self._conversation.ready

    async def send(self, item: Any) -> None:
        """Send ``item`` to the rank: its ``aiospawn.channel().receive()`` returns it.

        Waits while the rank does not read and more than 256 KiB wait to be
        written to it.

        Raises:
            TypeError: ``item`` cannot be pickled (its pickling raised, even
                ``SystemExit``: that is the cause).
            ValueError: ``item`` pickles to more than a frame carries (1 GiB).
            anyio.ClosedResourceError: :meth:`aclose` or :meth:`send_eof` was called.
            ProcessException: The rank has failed (exited badly, was killed or
                stopped, or broke its channel).
            anyio.BrokenResourceError: The rank has ended successfully, or closed its end.

        Cancellation:
            Safe: the message is queued whole or not at all. Once queued it is
            delivered, even if the task is cancelled while it is written.
        """
        await self._conversation.send(item)

    async def receive(self) -> Any:
        """Wait for the rank's next message and return it.

        Raises:
            anyio.EndOfStream: The rank closed its end (``close()``) or
                returned, and every message it sent has been received.
            ProcessException: The rank failed (raised, exited badly, was
                killed or stopped) with no message left to receive; or it
                broke its channel (a frame that is not aiospawn's).
            pickle.UnpicklingError: The next message cannot be unpickled here
                (its cause is what its unpickling raised, ``SystemExit``
                included). That message is dropped: the next ``receive()``
                gets the one after it.
            anyio.ClosedResourceError: :meth:`aclose` was called.

        Cancellation:
            Safe: a message is either returned (or its error raised) or stays
            first in line.
        """
        return await self._conversation.receive()

    async def send_eof(self) -> None:
        """Tell the rank nothing more comes: its ``receive()`` raises ``EOFError``.

        The rank's messages can still be received, and its calls answered.
        """
        await self._conversation.send_eof()

    async def aclose(self) -> None:
        """Close this end: the rank's ``receive()`` ends, its ``send()`` fails.

        Idempotent. Messages not yet received are dropped.
        """
        await self._conversation.aclose()

    def __repr__(self) -> str:
        return f"<RankChannel rank={self.rank}{self._conversation.summary()}>"


_CONSTRUCT = object()


class Conversation:
    """Everything the supervisor holds of one attempt's channel; :class:`RankChannel` fronts it.

    The group's owner runs :meth:`pump` for as long as the attempt's stream
    lasts: it sorts every frame the rank sends, and pushes out what senders
    queued that the socket did not take at once. Users' tasks (``send()``,
    ``receive()``, calls, ``wait_ready()``) only queue frames and wait for what
    the pump did, so frames move whether or not anyone waits for them, and a
    task cancelled at any point leaves nothing half done: a frame it queued is
    written whole by the pump.
    """

    def __init__(
        self,
        handle: RankHandle,
        link: Link,
        on_ready: Callable[[RankHandle], None],
        on_broken: Callable[[RankHandle, BrokenChannel], None],
        exit_of: Callable[[RankHandle], Awaitable[RankExit | None]],
        pool: SegmentPool | None = None,
    ) -> None:
        self._handle = handle
        #: The group's reused memfds for large buffers (``_pool``), if the link shares memory.
        self._pool = pool
        #: Set once the attempt is over (:meth:`drain_and_release`): its rank maps nothing.
        self.attempt_over = False
        self._exit_of = exit_of
        self._link = link
        self._on_ready = on_ready
        self._on_broken = on_broken
        #: Set once the rank sent a frame that breaks the format.
        self.broken: BrokenChannel | None = None
        self._inbox: collections.deque[Payload] = collections.deque()
        self._inbox_bytes = 0
        self._replies: dict[int, Payload | None] = {}
        #: Call id -> what wakes its caller when the reply comes (or none can).
        self._callers: dict[int, Broadcast] = {}
        # One wake-up per kind of change, so that each waits only for its own.
        self._arrived = Broadcast()  # a frame was sorted, or the stream ended
        self._room = Broadcast()  # the inbox has room again
        self._written = Broadcast()  # bytes went out, or writing failed
        self._pumping: anyio.abc.TaskGroup | None = None  # the pump's, while it runs
        self._writing = False  # a writer task is started ...
        self._writer_waits = False  # ... and waits for the socket to take more
        self._queued_bytes = 0  # bytes ever queued ...
        self._written_bytes = 0  # ... and ever written: a frame is out once this passes its end
        self._write_failed = False  # the rank's end is closed
        self._ended = False  # the stream from the rank ended (or the link was released)
        self._rank_closed = False  # ... because the rank closed its end
        self._closed = False  # aclose() was called
        self._eof_sent = False
        # Its callers have checkpointed already: an uncontended lock need not.
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._receive_lock = anyio.Lock(fast_acquire=True)
        self.ready_payload: Payload | None = None
        self._public: RankChannel | None = None
        self._eager = False  # the link's reader callback sorts frames (asyncio)

    @property
    def rank(self) -> int:
        """The rank at the other end."""
        return self._handle.rank

    @property
    def ready(self) -> bool:
        """True once the rank has called ``aiospawn.ready()``."""
        return self.ready_payload is not None

    @property
    def shares_memory(self) -> bool:
        """True if large buffers sent here may go through a memfd (``_rank.buffers``)."""
        return self._link.shares_memory

    @property
    def handle(self) -> RankChannel:
        """The public handle of this conversation (one, made on first use)."""
        if self._public is None:
            self._public = RankChannel._of(self)
        return self._public

    def summary(self) -> str:
        """The state, for ``repr``: `` ready``, `` ended``, `` closed``."""
        state = " ready" if self.ready else ""
        if self._closed:
            return state + " closed"
        return state + (" ended" if self._ended else "")

    # ------------------------------------------------------------ the owner's

    async def pump(self) -> None:
        """Read frames until the stream ends, and write what the socket did not take at once.

        The group's owner runs this. A frame is written as it is queued; a
        writer task is started only while the socket is full, so that a rank
        nobody writes to costs no task of its own.
        """
        eager = self._eager = hasattr(self._link, "eager") and runs_asyncio()
        if eager:
            # On asyncio the loop's reader callback sorts the common frames
            # itself, as asyncio's own transports do: a message then wakes
            # its receiver alone, not this task first.
            self._link.eager = self._sort_now  # type: ignore[attr-defined]
        try:
            async with anyio.create_task_group() as tg:
                self._pumping = tg
                try:
                    if self._link.queued:  # queued before the pump ran
                        self._start_writer()
                    await self._read_frames()
                finally:
                    self._pumping = None
                if self._writer_waits:
                    # A writer not yet run is left to end by itself (the
                    # stream has ended: it finds nothing to write); cancelled
                    # before its first step, its coroutine would never run.
                    tg.cancel_scope.cancel()
        finally:
            if eager:
                self._link.eager = None  # type: ignore[attr-defined]

    def _inbox_full(self) -> bool:
        return len(self._inbox) >= INBOX_MESSAGES or self._inbox_bytes >= INBOX_BYTES

    def _sort_now(self) -> bool:
        """Sort the frames readable now, from the link's reader callback (asyncio).

        Messages, replies and READY only: anything else (the end, a CLOSE, a
        broken frame, a full inbox) is left to the pump's task. Returns True
        if the task need not wake.
        """
        link = self._link
        while not self._ended:
            if self._inbox_full():
                return False
            try:
                frame = link.frame_after_wake()  # type: ignore[attr-defined]
            except FrameError:
                return False  # the task reads it again, and breaks the channel
            if frame is False:
                return True
            if frame is None or frame is True:
                return False
            if frame[0] not in _EAGER_KINDS:
                link.unread(frame)  # type: ignore[attr-defined]
                return False
            self._take(frame)
            del frame
        return False

    def drain_and_release(self) -> None:
        """Sort every frame that can be read now, then release the transport: the attempt is over.

        What the rank sent just before it exited is still in the socket, and
        stays receivable once the transport is released. Released at the exit,
        not at the end of the stream: a process the rank started may hold the
        rank's end open.
        """
        while not self._ended:
            try:
                frame = self._link.frame_now()
            except FrameError as exc:
                self._break(exc)
                break
            if frame is False:
                break
            self._take(frame if isinstance(frame, tuple) else None)
        self.release()
        self.attempt_over = True
        if self._pool is not None:
            # The rank has exited: it maps nothing any more.
            self._pool.forget_holder(self)

    def release(self) -> None:
        """Release the transport (the attempt is over or was replaced); no waiting."""
        if not self._ended:
            self._ended = True
            self._link.close()
            for change in (self._arrived, self._room, self._written):
                change.notify()
            self._wake_callers()

    def close_sending(self) -> None:
        """:meth:`send_eof` without waiting: the writer sends the frame as the socket takes it."""
        if not (self._closed or self._eof_sent or self._ended):
            self._eof_sent = True
            self._queue(Kind.CLOSE, b"")

    async def _read_frames(self) -> None:
        while not self._ended:
            if self._inbox_full():
                # Full: nothing more is read, and the rank's send() blocks
                # once the socket is full, until a receive() makes room.
                await self._room.wait()
                continue
            try:
                frame = await self._link.receive_frame()
            except FrameError as exc:
                self._break(exc)
                return
            if frame is not None and self._inbox_full() and self._eager:
                # The reader callback filled the inbox while this task waited:
                # the frame goes back, to be taken once there is room.
                self._link.unread(frame)  # type: ignore[attr-defined]
                continue
            self._take(frame)
            # Not kept while the next frame is awaited: a received array
            # (and its mapping) lives as long as its receiver holds it.
            del frame

    def _start_writer(self) -> None:
        if not self._writing and self._pumping is not None:
            self._writing = True
            self._pumping.start_soon(self._write_queued)

    async def _write_queued(self) -> None:
        """Write out the queue as the socket takes it; end once it is empty or writing has ended."""
        try:
            while not self._write_some():
                self._writer_waits = True
                try:
                    await self._link.wait_writable()
                finally:
                    self._writer_waits = False
        finally:
            self._writing = False

    # ------------------------------------------------------------ the users'

    async def send(self, item: Any) -> None:
        """:meth:`RankChannel.send`."""
        await checkpoint_if_cancelled()
        self._check_sendable()
        packed = await encode(item, self._link.shares_memory, self._pool)
        try:
            await self._send_frame(
                Kind.MESSAGE | packed.flag, packed.body, self._claimer(packed), packed.fd
            )
        finally:
            packed.close()  # the queue holds a copy of its own
        # The checkpoint's yield comes once the frame is out, while the rank
        # reads it, rather than before, where it adds to the message's latency.
        await checkpoint()

    async def receive(self) -> Any:
        """:meth:`RankChannel.receive`."""
        await checkpoint_if_cancelled()
        async with self._receive_lock:
            if self._inbox or self._ended:
                await checkpoint()  # a checkpoint even when nothing is waited for
            else:  # the wait is the checkpoint
                await self._wait_for(lambda: bool(self._inbox))
            if self._closed:
                raise anyio.ClosedResourceError
            if self._inbox:
                payload = self._inbox[0]
                # Taken only once decoded (or found undecodable): a receive
                # cancelled meanwhile leaves the message first in line.
                try:
                    item = await decode(payload, f"rank {self.rank}'s message")
                except pickle.UnpicklingError:
                    self._take_first()  # its error is reported once; the next one follows
                    raise
                self._take_first()
                return item
        await self._raise_end()

    def _take_first(self) -> None:
        payload = self._inbox.popleft()
        self._inbox_bytes -= len(payload)
        self._room.notify()

    async def send_eof(self) -> None:
        """:meth:`RankChannel.send_eof`."""
        await checkpoint()
        if self._closed or self._eof_sent:
            return
        self._eof_sent = True
        # The rank may have ended: then there is nobody to tell.
        with contextlib.suppress(ProcessException, anyio.BrokenResourceError, anyio.EndOfStream):
            async with self._send_lock:
                await self._deliver(Kind.CLOSE, b"")

    async def aclose(self) -> None:
        """:meth:`RankChannel.aclose`."""
        if not self._closed:
            # No CLOSE frame first: a rank could read it and send before the
            # release below, and its send would succeed into the void. The
            # release shuts the socket down: its receive() ends, its send() fails.
            self._closed = True
            self.release()
        await checkpoint()

    async def start_call(self, call_id: int, request: Packed, answered: Broadcast) -> None:
        """Queue one CALL frame; ``answered`` is notified when its reply comes, or none can.

        ``request`` may go to several ranks: each queue holds a copy of its
        memfd, and the caller closes its own. The caller then reads
        :meth:`reply` and :meth:`unanswerable` each time ``answered`` wakes it,
        and calls :meth:`end_call` whatever happens.

        Raises:
            anyio.ClosedResourceError: This end was closed (or its EOF sent).

        Cancellation:
            While it waits for room in the queue (back-pressure), nothing is
            queued; once queued, :meth:`end_call` sends the CANCEL.
        """
        self._check_sendable()
        async with self._send_lock:
            while self._link.queued >= QUEUED_BYTES and not self._stopped_writing():
                await self._written.wait()
            self._check_sendable()
            self._replies[call_id] = None
            self._callers[call_id] = answered
            if not self._stopped_writing():
                self._queue(
                    Kind.CALL | request.flag, CALL_ID.pack(call_id) + request.body, request.fd
                )
                if isinstance(request, PooledPacked):
                    request.claim(self)  # this rank maps the segment until it says otherwise

    def reply(self, call_id: int) -> Payload | None:
        """The payload of the reply to ``call_id``, once it came."""
        return self._replies.get(call_id)

    def unanswerable(self, call_id: int) -> bool:
        """True if no reply to ``call_id`` came and none can come any more."""
        return self._replies.get(call_id) is None and self._stopped_writing()

    async def call_error(self) -> Exception:
        """What a call this rank can no longer answer raises: how its stream ended."""
        try:
            await self._raise_end(f"rank {self.rank} ended before it answered")
        except (ProcessException, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            return exc
        raise AssertionError("unreachable")

    def end_call(self, call_id: int) -> None:
        """The caller is done with ``call_id``: a reply that comes later is dropped.

        If none came yet, a CANCEL frame follows the CALL (queued without
        waiting), so that the rank cancels the handler.
        """
        self._callers.pop(call_id, None)
        if call_id in self._replies and self._replies.pop(call_id) is None:
            self._cancel_call(call_id)

    def _claimer(self, packed: Packed) -> Callable[[], None] | None:
        """What claims ``packed``'s segment for this rank once its frame is queued, if pooled."""
        if not isinstance(packed, PooledPacked):
            return None
        return lambda: packed.claim(self)

    def _cancel_call(self, call_id: int) -> None:
        """Tell the rank nobody waits for ``call_id`` any more: it cancels the handler.

        Queued without waiting (the caller is being cancelled) and past the
        back-pressure bound: it is a few bytes, once per call. Nothing is sent
        once the rank cannot read it (ended, or after our CLOSE).
        """
        if not (self._closed or self._eof_sent or self._stopped_writing()):
            self._queue(Kind.CANCEL, CALL_ID.pack(call_id))

    async def wait_ready(self) -> None:
        """Wait until the rank is ready, or its stream has ended."""
        await self._wait_for(lambda: self.ready)

    # ------------------------------------------------------------------ inside

    def _check_sendable(self) -> None:
        if self._closed or self._eof_sent:
            raise anyio.ClosedResourceError

    async def _send_frame(
        self,
        kind: int,
        payload: bytes,
        on_queued: Callable[[], None] | None = None,
        fd: int = -1,
    ) -> None:
        async with self._send_lock:
            # Back-pressure: queued whole once little enough waits before it.
            while self._link.queued >= QUEUED_BYTES and not self._stopped_writing():
                await self._written.wait()
            self._check_sendable()
            await self._deliver(kind, payload, on_queued, fd)

    async def _deliver(
        self,
        kind: int,
        payload: bytes,
        on_queued: Callable[[], None] | None = None,
        fd: int = -1,
    ) -> None:
        """Queue a frame and wait until it is written; cancelled, the writer still writes it.

        ``on_queued`` is called once the frame is queued: from then on it goes out.
        """
        if self._stopped_writing():
            await self._raise_end(f"rank {self.rank} has ended")
        end = self._queue(kind, payload, fd)
        if on_queued is not None:
            on_queued()
        while self._written_bytes < end:
            if self._stopped_writing():
                await self._raise_end(f"rank {self.rank} has ended")
            await self._written.wait()

    def _queue(self, kind: int, payload: bytes, fd: int = -1) -> int:
        """Queue a frame, write what the socket takes now; return where the frame ends."""
        before = self._link.queued
        self._link.queue_frame(kind, payload, fd)
        self._queued_bytes += self._link.queued - before
        if not self._write_some():
            self._start_writer()
        return self._queued_bytes

    def _write_some(self) -> bool:
        """Write what the socket takes now; True once nothing is left queued."""
        if self._ended or self._write_failed:
            return True
        before = self._link.queued
        try:
            done = self._link.write_some()
        except OSError:  # the rank's end is closed: it has exited
            self._write_failed = True
            self._wake_callers()
            done = True
        else:
            self._written_bytes += before - self._link.queued
        self._written.notify()
        return done

    def _stopped_writing(self) -> bool:
        return self._ended or self._write_failed

    async def _wait_for(self, done: Callable[[], bool]) -> None:
        """Return once ``done()``, or the stream has ended (or :meth:`aclose` was called)."""
        while not (done() or self._ended):
            await self._arrived.wait()

    def _wake_callers(self) -> None:
        for caller in self._callers.values():
            caller.notify()

    def _break(self, error: FrameError) -> None:
        """The rank sent a frame that breaks the format: read nothing more, report it."""
        if self.broken is None:
            self.broken = BrokenChannel(
                rank=self.rank, pid=self._handle.pid or 0, reason=str(error)
            )
            self.release()
            self._on_broken(self._handle, self.broken)

    def _take(self, frame: tuple[int, Payload] | None) -> None:
        """Sort one frame (None: the end of the stream); nothing is decoded here."""
        if frame is None:
            self.release()
            return
        kind, payload = frame
        if kind == Kind.MESSAGE:
            self._inbox.append(payload)
            self._inbox_bytes += len(payload)
        elif kind == Kind.REPLY:
            call_id = call_id_of(payload)
            if call_id in self._replies:  # else the call was cancelled or timed out
                self._replies[call_id] = (
                    payload.after(CALL_ID.size)
                    if isinstance(payload, Mapped)
                    else memoryview(payload)[CALL_ID.size :].tobytes()
                )
                caller = self._callers.get(call_id)
                if caller is not None:
                    caller.notify()
        elif kind == Kind.READY:
            if self.ready_payload is None:
                self.ready_payload = payload
                self._on_ready(self._handle)
        elif kind == Kind.CLOSE:
            self._rank_closed = True
            self.release()
            return
        elif kind == Kind.RELEASED:
            if self._pool is not None and not isinstance(payload, Mapped):
                self._pool.released(TOKEN.unpack(payload)[0], self)
            return
        self._arrived.notify()

    async def _raise_end(self, message: str | None = None) -> None:
        """Raise how the stream ended: EndOfStream, or the rank's failure."""
        if self._closed:
            raise anyio.ClosedResourceError
        if self.broken is not None:
            raise self.broken.exception()
        if not self._rank_closed:
            # As the group records it: by then, what follows from the exit
            # (a restart, the group's failure) is decided too.
            exit = await self._exit_of(self._handle)
            if exit is not None and not exit.succeeded:
                raise exit.exception()
        if message is not None:
            raise anyio.BrokenResourceError(message)
        raise anyio.EndOfStream
