"""The core's side of one attempt's channel: messages, readiness and calls, on the event loop.

Each attempt at a rank that has a ``Link`` (the backend's frame transport,
``_backend.Link``: a socket pair for local ranks) has one
:class:`Conversation`, made by the group's live ranks (``_live``, which read
readiness and make calls through it); users hold its thin public handle,
``_channel.RankChannel``.

The group's owner pumps every conversation for as long as its attempt runs
(:meth:`Conversation.pump`): a reader (``_inbound``) sorts each frame the
rank sends (a message's pickle into the inbox, a reply's to its call, a READY
payload to the channel) and a writer (``_outbound``) writes what senders
queued. Users' tasks only queue frames and wait for the pump: nothing is
decoded while a frame is taken, so a task cancelled at any point loses
nothing, and a frame queued by a send that is cancelled meanwhile is still
written whole. The task that wants an object decodes it (``_pickles``: off
the loop when it is large). A message that cannot be decoded leaves the inbox
with the error it raised: the next ``receive()`` gets the next message. The
attempt's exit ends its channel (the owner releases it), after the frames the
rank sent before it. Back-pressure holds both ways: a full inbox stops the
reading (``_inbound.INBOX_MESSAGES``), and a ``send()`` queues its frame
whole once less than ``_outbound.QUEUED_BYTES`` wait to be written.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

from aiospawn._rank.buffers import Packed
from aiospawn._rank.wire import CALL_ID, Payload
from aiospawn._rank.wire import Link as Kind

from ._backend import Link, RankHandle
from ._channel import RankChannel
from ._concurrency import Broadcast
from ._errors import ProcessException
from ._inbound import Inbound
from ._loops import runs_asyncio
from ._outbound import Outbound
from ._outcome import BrokenChannel, RankExit
from ._pickles import decode, encode
from ._pool import PooledPacked, SegmentPool


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
        # What senders queued, and the pump's writer; a failed write wakes the callers.
        self._outbound = Outbound(link, lambda: self._inbound.wake_callers())
        # What the rank sent, sorted by the pump's reader; the end of its
        # stream ends the writing too.
        self._inbound = Inbound(
            handle,
            link,
            on_ready=on_ready,
            on_broken=on_broken,
            on_end=self._outbound.end,
            on_taken=self._outbound.taken,
            pool=pool,
            holder=self,
        )
        self._closed = False  # aclose() was called
        self._eof_sent = False
        # Its callers have checkpointed already: an uncontended lock need not.
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._receive_lock = anyio.Lock(fast_acquire=True)
        self._public: RankChannel | None = None

    @property
    def rank(self) -> int:
        """The rank at the other end."""
        return self._handle.rank

    @property
    def ready(self) -> bool:
        """True once the rank has called ``aiospawn.ready()``."""
        return self._inbound.ready_payload is not None

    @property
    def ready_payload(self) -> Payload | None:
        """What the rank passed to ``aiospawn.ready()``, pickled; None before it did."""
        return self._inbound.ready_payload

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
        return state + (" ended" if self._inbound.ended else "")

    # ------------------------------------------------------------ the owner's

    async def pump(self) -> None:
        """Read frames until the stream ends, and write what the socket did not take at once.

        The group's owner runs this. A frame is written as it is queued; a
        writer task is started only while the socket is full, so that a rank
        nobody writes to costs no task of its own.
        """
        eager = hasattr(self._link, "eager") and runs_asyncio()
        if eager:
            # On asyncio the loop's reader callback sorts the common frames
            # itself, as asyncio's own transports do: a message then wakes
            # its receiver alone, not this task first.
            self._link.eager = self._inbound.sort_now  # type: ignore[attr-defined]
        try:
            async with anyio.create_task_group() as tg:
                try:
                    self._outbound.start_pumping(tg)
                    await self._inbound.read_frames(eager)
                finally:
                    self._outbound.stop_pumping()
                if self._outbound.writer_waits:
                    # A writer not yet run is left to end by itself (the
                    # stream has ended: it finds nothing to write); cancelled
                    # before its first step, its coroutine would never run.
                    tg.cancel_scope.cancel()
        finally:
            if eager:
                self._link.eager = None  # type: ignore[attr-defined]

    def drain_and_release(self) -> None:
        """Sort every frame that can be read now, then release the transport: the attempt is over.

        What the rank sent just before it exited is still in the socket, and
        stays receivable once the transport is released. Released at the exit,
        not at the end of the stream: a process the rank started may hold the
        rank's end open.
        """
        self._inbound.drain()
        self._inbound.release()
        self.attempt_over = True
        if self._pool is not None:
            # The rank has exited: it maps nothing any more.
            self._pool.forget_holder(self)

    def close_sending(self) -> None:
        """:meth:`send_eof` without waiting: the writer sends the frame as the socket takes it."""
        if not (self._closed or self._eof_sent or self._inbound.ended):
            self._eof_sent = True
            self._outbound.queue(Kind.CLOSE, b"")

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
        inbound = self._inbound
        async with self._receive_lock:
            if inbound.messages or inbound.ended:
                await checkpoint()  # a checkpoint even when nothing is waited for
            else:  # the wait is the checkpoint
                await inbound.wait_for(lambda: bool(inbound.messages))
            if self._closed:
                raise anyio.ClosedResourceError
            if inbound.messages:
                payload = inbound.messages[0]
                # Taken only once decoded (or found undecodable): a receive
                # cancelled meanwhile leaves the message first in line.
                try:
                    item = await decode(payload, f"rank {self.rank}'s message")
                except pickle.UnpicklingError:
                    inbound.take_first()  # its error is reported once; the next one follows
                    raise
                inbound.take_first()
                return item
        await self._raise_end()

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
            self._inbound.release()
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
            await self._outbound.wait_for_room()
            self._check_sendable()
            self._inbound.expect(call_id, answered)
            if not self._outbound.stopped:
                # The call's id before the request, not joined to it: a large
                # request asked of N ranks is queued N times, copied none.
                self._outbound.queue(
                    Kind.CALL | request.flag, request.body, request.fd, CALL_ID.pack(call_id)
                )
                if isinstance(request, PooledPacked):
                    request.claim(self)  # this rank maps the segment until it says otherwise

    def reply(self, call_id: int) -> Payload | None:
        """The payload of the reply to ``call_id``, once it came."""
        return self._inbound.reply(call_id)

    def unanswerable(self, call_id: int) -> bool:
        """True if no reply to ``call_id`` came and none can come any more."""
        return self._inbound.reply(call_id) is None and self._outbound.stopped

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
        if self._inbound.forget(call_id):
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
        if not (self._closed or self._eof_sent or self._outbound.stopped):
            self._outbound.queue(Kind.CANCEL, CALL_ID.pack(call_id))

    async def wait_ready(self) -> None:
        """Wait until the rank is ready, or its stream has ended."""
        await self._inbound.wait_for(lambda: self.ready)

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
            await self._outbound.wait_for_room()
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
        if self._outbound.stopped:
            await self._raise_end(f"rank {self.rank} has ended")
        end = self._outbound.queue(kind, payload, fd)
        if on_queued is not None:
            on_queued()
        if not await self._outbound.wait_written(end):
            await self._raise_end(f"rank {self.rank} has ended")

    async def _raise_end(self, message: str | None = None) -> None:
        """Raise how the stream ended: EndOfStream, or the rank's failure."""
        if self._closed:
            raise anyio.ClosedResourceError
        broken = self._inbound.broken
        if broken is not None:
            raise broken.exception()
        if not self._inbound.rank_closed:
            # As the group records it: by then, what follows from the exit
            # (a restart, the group's failure) is decided too.
            exit = await self._exit_of(self._handle)
            if exit is not None and not exit.succeeded:
                raise exit.exception()
        if message is not None:
            raise anyio.BrokenResourceError(message)
        raise anyio.EndOfStream
