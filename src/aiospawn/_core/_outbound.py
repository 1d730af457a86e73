"""The frames queued for one rank, and their writing: the pump's writer side.

Each :class:`~._conversation.Conversation` has one :class:`Outbound` over its
``Link``. A frame is written as it is queued, as far as the socket takes it
then; a writer task, started in the pump's task group, writes the rest only
while the socket is full, so a rank nobody writes to costs no task of its
own. A frame once queued goes out whole, whatever happens to the task that
queued it. Back-pressure: a sender waits (:meth:`Outbound.wait_for_room`)
until less than :data:`QUEUED_BYTES` wait to be written, and less than
:data:`UNTAKEN_BYTES` of large buffers sent in memfds wait for the rank to
take them (it says so with a TAKEN frame, which the reader hands to
:meth:`Outbound.taken`).

Used by ``_conversation`` only; imports the core's own modules, the rank's
wire format, anyio and the standard library.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable

import anyio.abc

from aiospawn._rank.buffers import SHARED
from aiospawn._rank.wire import Link as Kind

from ._backend import Link
from ._concurrency import Broadcast

#: Bytes that may wait in the outgoing queue when a ``send()`` adds its frame.
QUEUED_BYTES = 256 * 1024
#: Bytes of large buffers sent through shared memory (a frame's memfd) that the
#: rank may not have taken yet when a ``send()`` or a call adds its frame. They
#: count as their frame alone in :data:`QUEUED_BYTES`, and a written frame
#: leaves the queue, so without this bound a rank that does not read would
#: let about as many such frames wait as its socket's buffer holds (some
#: 280 here), whatever their size.
UNTAKEN_BYTES = 64 * 1024 * 1024


class Outbound:
    """What the supervisor queued for one attempt, and how much of it is written.

    Args:
        link: The attempt's frame transport.
        on_failed: Called once writing fails: the rank's end is closed.
    """

    def __init__(self, link: Link, on_failed: Callable[[], None]) -> None:
        self._link = link
        self._on_failed = on_failed
        #: Notified when bytes went out, writing failed, or it ended (:meth:`end`).
        self.written = Broadcast()
        self._pumping: anyio.abc.TaskGroup | None = None  # the pump's, while it runs
        self._writing = False  # a writer task is started ...
        self.writer_waits = False  # ... and waits for the socket to take more
        self._queued_bytes = 0  # bytes ever queued ...
        self._written_bytes = 0  # ... and ever written: a frame is out once this passes its end
        self._failed = False  # the rank's end is closed
        self._ended = False  # the stream from the rank ended (or the link was released)
        # The sizes of the memfds sent with MESSAGE and CALL frames that the
        # rank has not taken, oldest first (each kind is taken in order), and their sum.
        self._untaken: dict[int, collections.deque[int]] = {
            Kind.MESSAGE: collections.deque(),
            Kind.CALL: collections.deque(),
        }
        self._untaken_bytes = 0

    @property
    def stopped(self) -> bool:
        """True once nothing more is written: the stream ended, or writing failed."""
        return self._ended or self._failed

    def end(self) -> None:
        """The stream ended or the link was released: nothing more is written; senders wake."""
        self._ended = True
        self.written.notify()

    def start_pumping(self, tg: anyio.abc.TaskGroup) -> None:
        """The pump runs in ``tg``: a writer task may start there, now if frames wait."""
        self._pumping = tg
        if self._link.queued:  # queued before the pump ran
            self._start_writer()

    def stop_pumping(self) -> None:
        """The pump's reader has ended: no writer task starts any more."""
        self._pumping = None

    async def wait_for_room(self) -> None:
        """Back-pressure: return once little enough waits, or nothing more will be written.

        Little enough: under :data:`QUEUED_BYTES` queued, and under
        :data:`UNTAKEN_BYTES` of large buffers the rank has not taken.
        """
        while (
            self._link.queued >= QUEUED_BYTES or self._untaken_bytes >= UNTAKEN_BYTES
        ) and not self.stopped:
            await self.written.wait()

    def taken(self, kind: int) -> None:
        """The rank took its oldest ``kind`` frame that came with a memfd (a TAKEN frame)."""
        sizes = self._untaken.get(kind)
        if sizes:  # else not one we counted: nothing to give back
            self._untaken_bytes -= sizes.popleft()
            self.written.notify()

    def queue(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> int:
        """Queue a frame (``prefix``, then ``payload``), write what the socket takes now.

        Returns:
            Where the frame ends in the stream of bytes queued.
        """
        before = self._link.queued
        self._link.queue_frame(kind, payload, fd, prefix)
        self._queued_bytes += self._link.queued - before
        if fd >= 0:  # its buffers count until the rank has taken the frame
            size = os.fstat(fd).st_size
            self._untaken[kind & ~SHARED].append(size)
            self._untaken_bytes += size
        if not self._write_some():
            self._start_writer()
        return self._queued_bytes

    async def wait_written(self, end: int) -> bool:
        """Wait until the queue is written up to ``end``; False if writing stopped first.

        Cancellation:
            The writer still writes the frame.
        """
        while self._written_bytes < end:
            if self.stopped:
                return False
            await self.written.wait()
        return True

    def _write_some(self) -> bool:
        """Write what the socket takes now; True once nothing is left queued."""
        if self._ended or self._failed:
            return True
        before = self._link.queued
        try:
            done = self._link.write_some()
        except OSError:  # the rank's end is closed: it has exited
            self._failed = True
            self._on_failed()
            done = True
        else:
            self._written_bytes += before - self._link.queued
        self.written.notify()
        return done

    def _start_writer(self) -> None:
        if not self._writing and self._pumping is not None:
            self._writing = True
            self._pumping.start_soon(self._write_queued)

    async def _write_queued(self) -> None:
        """Write out the queue as the socket takes it; end once it is empty or writing has ended."""
        try:
            while not self._write_some():
                self.writer_waits = True
                try:
                    await self._link.wait_writable()
                finally:
                    self.writer_waits = False
        finally:
            self._writing = False
