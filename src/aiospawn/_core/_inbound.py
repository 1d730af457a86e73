"""What comes in from one rank: its frames read and sorted, on the event loop.

Each :class:`~._conversation.Conversation` has one :class:`Inbound` over its
``Link``: the pump's reader (:meth:`Inbound.read_frames`; on asyncio the
link's reader callback too, :meth:`Inbound.sort_now`) sorts each frame the
rank sends, a message's pickle into the inbox, a reply's to its call, a
READY payload to the channel, a RELEASED segment to the pool, a TAKEN one to
the writer's back-pressure (``_outbound``), without decoding anything, so a
reader cancelled at any point loses nothing. The end of the stream, a CLOSE from
the rank, or the release of the link ends it.

A frame header that breaks the format (a kind a rank does not send, a size
out of range: ``wire.FROM_RANK``) breaks the channel: nothing more is read
from it, its users get the rank's failure, and the group fails that rank
(:class:`~._outcome.BrokenChannel`) as it fails a hung one.

Back-pressure: the inbox holds :data:`INBOX_MESSAGES` messages (or
:data:`INBOX_BYTES`); while it is full nothing more is read, so the rank's
``send()`` blocks once the socket is full too, and so do its replies and
READY behind those messages.

Used by ``_conversation`` only; imports the core's own modules, the rank's
wire format and buffers, anyio and the standard library.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from aiospawn._rank.buffers import TOKEN, Mapped
from aiospawn._rank.wire import CALL_ID, FrameError, Payload, call_id_of
from aiospawn._rank.wire import Link as Kind

from ._backend import Link, RankHandle
from ._concurrency import Broadcast
from ._outcome import BrokenChannel
from ._pool import SegmentPool

#: Messages (and bytes of them) the supervisor holds for a rank's ``receive()``.
INBOX_MESSAGES = 64
INBOX_BYTES = 64 * 1024 * 1024

#: The frames the reader callback sorts itself (:meth:`Inbound.sort_now`): the
#: bookkeeping ones too, which would otherwise wake the pump's task for nothing.
_EAGER_KINDS = frozenset({Kind.MESSAGE, Kind.REPLY, Kind.READY, Kind.RELEASED, Kind.TAKEN})


class Inbound:
    """What one attempt's rank sent, sorted for whoever waits for it, and how its stream ended.

    Args:
        handle: The attempt.
        link: The attempt's frame transport.
        on_ready: Called with ``handle`` at the rank's first READY.
        on_broken: Called when the rank sent a frame that breaks the format.
        on_end: Called once the link is released: nothing more is written.
        pool: The group's reused memfds (``_pool``), whose claims a RELEASED
            frame gives back, if the link shares memory.
        holder: Whose claims those are (the conversation).
    """

    def __init__(
        self,
        handle: RankHandle,
        link: Link,
        *,
        on_ready: Callable[[RankHandle], None],
        on_broken: Callable[[RankHandle, BrokenChannel], None],
        on_end: Callable[[], None],
        on_taken: Callable[[int], None],
        pool: SegmentPool | None,
        holder: object,
    ) -> None:
        self._handle = handle
        self._link = link
        self._on_ready = on_ready
        self._on_broken = on_broken
        self._on_end = on_end
        self._on_taken = on_taken
        self._pool = pool
        self._holder = holder
        #: Set once the rank sent a frame that breaks the format.
        self.broken: BrokenChannel | None = None
        #: The messages not yet received, oldest first.
        self.messages: collections.deque[Payload] = collections.deque()
        self._inbox_bytes = 0
        self._replies: dict[int, Payload | None] = {}
        #: Call id -> what wakes its caller when the reply comes (or none can).
        self._callers: dict[int, Broadcast] = {}
        # One wake-up per kind of change, so that each waits only for its own.
        self._arrived = Broadcast()  # a frame was sorted, or the stream ended
        self._room = Broadcast()  # the inbox has room again
        self.ended = False  # the stream from the rank ended (or the link was released)
        self.rank_closed = False  # ... because the rank closed its end
        self.ready_payload: Payload | None = None

    async def read_frames(self, eager: bool) -> None:
        """The pump's reader: sort frames until the stream ends.

        ``eager``: the link's reader callback runs :meth:`sort_now` meanwhile.
        """
        while not self.ended:
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
            if frame is not None and self._inbox_full() and eager:
                # The reader callback filled the inbox while this task waited:
                # the frame goes back, to be taken once there is room.
                self._link.unread(frame)  # type: ignore[attr-defined]
                continue
            self._take(frame)
            # Not kept while the next frame is awaited: a received array
            # (and its mapping) lives as long as its receiver holds it.
            del frame

    def sort_now(self) -> bool:
        """Sort the frames readable now, from the link's reader callback (asyncio).

        Messages, replies, READY, RELEASED and TAKEN only: anything else (the
        end, a CLOSE, a broken frame, a full inbox) is left to the pump's task. Returns True
        if the task need not wake.
        """
        link = self._link
        while not self.ended:
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

    def drain(self) -> None:
        """Sort every frame that can be read now, without waiting (the attempt is over)."""
        while not self.ended:
            try:
                frame = self._link.frame_now()
            except FrameError as exc:
                self._break(exc)
                break
            if frame is False:
                break
            self._take(frame if isinstance(frame, tuple) else None)

    def release(self) -> None:
        """Release the transport (the attempt is over or was replaced); no waiting."""
        if not self.ended:
            self.ended = True
            self._link.close()
            for change in (self._arrived, self._room):
                change.notify()
            self._on_end()  # nothing more is written; waiting senders wake
            self.wake_callers()

    def take_first(self) -> None:
        """Drop the first message: it was received (or found undecodable)."""
        payload = self.messages.popleft()
        self._inbox_bytes -= len(payload)
        self._room.notify()

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Return once ``done()``, or the stream has ended (or the link was released)."""
        while not (done() or self.ended):
            await self._arrived.wait()

    # ------------------------------------------------------------------ calls

    def expect(self, call_id: int, answered: Broadcast) -> None:
        """A CALL is about to be queued: keep its reply, and notify ``answered`` when it comes."""
        self._replies[call_id] = None
        self._callers[call_id] = answered

    def reply(self, call_id: int) -> Payload | None:
        """The payload of the reply to ``call_id``, once it came."""
        return self._replies.get(call_id)

    def forget(self, call_id: int) -> bool:
        """The caller is done with ``call_id``: a reply that comes later is dropped.

        Returns True if none came yet (the rank is still to cancel the handler).
        """
        self._callers.pop(call_id, None)
        return call_id in self._replies and self._replies.pop(call_id) is None

    def wake_callers(self) -> None:
        """Wake every caller: no reply may come any more."""
        for caller in self._callers.values():
            caller.notify()

    # ------------------------------------------------------------------ inside

    def _inbox_full(self) -> bool:
        return len(self.messages) >= INBOX_MESSAGES or self._inbox_bytes >= INBOX_BYTES

    def _break(self, error: FrameError) -> None:
        """The rank sent a frame that breaks the format: read nothing more, report it."""
        if self.broken is None:
            self.broken = BrokenChannel(
                rank=self._handle.rank, pid=self._handle.pid or 0, reason=str(error)
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
            self.messages.append(payload)
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
            self.rank_closed = True
            self.release()
            return
        elif kind == Kind.RELEASED:
            if self._pool is not None and not isinstance(payload, Mapped):
                self._pool.released(TOKEN.unpack(payload)[0], self._holder)
            return
        elif kind == Kind.TAKEN:
            if not isinstance(payload, Mapped):  # never one: the kind carries no memfd
                self._on_taken(payload[0])
            return
        self._arrived.notify()
