"""A local rank's channel transport: one end of a Unix socket pair, read on the event loop.

The supervisor keeps one end (non-blocking), the rank gets the other (see
``aiospawn._rank.channel``); both are made with the rank, like its result
pipe, and recorded in the descriptor table a ``fork`` rank clears. Frames
whose large buffers are in a memfd carry its descriptor (``_rank.buffers``):
reads take descriptors with the bytes (``recvmsg``), and the reader hands
each to its frame. Each read takes what the socket holds, however many frames
(``stream.FrameStream``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._loops import runs_asyncio
from aiospawn._rank import buffers
from aiospawn._rank.stream import FrameQueue, FrameStream
from aiospawn._rank.wire import FROM_RANK, ChildEnd, Payload

from . import _pipes

#: At most this much is read per wake-up, so that the loop runs other tasks between.
_READ_BUDGET = 1024 * 1024


def rank_socket() -> tuple[int, ChildEnd]:
    """Make a rank's channel: ``(our end, the rank's end)``, both close-on-exec."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return _pipes.track(ours.detach()), ChildEnd(_pipes.track(theirs.detach()))


class SocketLink:
    """The supervisor's end of one local rank's channel (see ``_core._backend.Link``)."""

    #: Frames may carry a memfd: the rank's socket passes descriptors.
    shares_memory = buffers.AVAILABLE

    #: The group's pool (``_core._pool``) records the memfds it keeps open as
    #: the local backend's, so that a ``fork`` rank closes its copies: a
    #: segment the pool gave up would otherwise stay in memory for as long
    #: as such a rank lives.
    keep_descriptor = staticmethod(_pipes.track)
    drop_descriptor = staticmethod(_pipes.forget)

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        # It only borrows the descriptor, which close() (or _pipes) closes.
        self._in = FrameStream(FROM_RANK, self.shares_memory, fd)
        self._budget_spent = False  # frame_now() stopped for the loop's sake, not for data
        self._drained = False  # the last read took less than it could: wait before the next
        self._out = FrameQueue()
        # On asyncio, one reader callback stays registered while frames keep
        # coming (anyio's wait_readable() adds and removes one per wait: two
        # epoll_ctl calls per message). None until the first wait tells the loop.
        self._asyncio: bool | None = None
        self._loop: Any = None
        self._waiter: Any = None  # the future the reading task awaits
        self._watching = False
        #: On asyncio, called by the reader callback while the reading task
        #: waits: it sorts what can be read there and then, and returns True
        #: if the task need not wake (see ``Conversation.pump``).
        self.eager: Callable[[], bool] | None = None
        self._unread: tuple[int, Payload] | None = None  # given back by eager(): next out

    async def receive_frame(self) -> tuple[int, Payload] | None:
        """The next frame, or None at the end of the stream; cancellation-safe.

        Raises:
            FrameError: The rank sent a header that breaks the format.
        """
        while True:
            frame = self._frame(trust_drained=True)
            if frame is not False:
                assert frame is not True
                return frame
            if self._budget_spent:  # a large frame: let other tasks run between reads
                self._budget_spent = False
                await checkpoint()
                continue
            self._drained = False
            fd = self._fd
            if fd is None:
                return None
            try:
                await self._wait_readable(fd)
            except anyio.ClosedResourceError:  # released meanwhile
                return None

    async def _wait_readable(self, fd: int) -> None:
        if self._asyncio is None:
            self._asyncio = runs_asyncio()
        if not self._asyncio:
            await anyio.wait_readable(fd)
            return
        import asyncio  # loaded already

        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        if not self._watching:
            loop.add_reader(fd, self._readable)
            self._loop, self._watching = loop, True
        try:
            await waiter
        finally:
            self._waiter = None

    def _readable(self) -> None:
        """The loop's reader callback: sort frames here, or wake the reading task.

        If nobody waits, it stops watching: the reader is level-triggered,
        so nothing is lost until the next wait.
        """
        waiter = self._waiter
        if waiter is None or waiter.done():
            self._unwatch()
            return
        self._drained = False  # readable: the next read finds something
        if self.eager is not None and self.eager():
            self._budget_spent = False  # the callback comes again on the next pass of the loop
            return
        waiter.set_result(None)

    def unread(self, frame: tuple[int, Payload]) -> None:
        """Give back the frame just read: the next read returns it first."""
        self._unread = frame

    def frame_after_wake(self) -> tuple[int, Payload] | bool | None:
        """:meth:`frame_now` for the reader callback: no read after one that emptied the socket."""
        return self._frame(trust_drained=True)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            if self._fd is not None:
                self._loop.remove_reader(self._fd)

    def frame_now(self) -> tuple[int, Payload] | bool | None:
        """The next frame if it can be read without waiting; None at the end, else False.

        Raises:
            FrameError: The rank sent a header that breaks the format (checked
                as the header is read: of its payload, no more is kept than
                one read took).
        """
        return self._frame(trust_drained=False)

    def _frame(self, trust_drained: bool) -> tuple[int, Payload] | bool | None:
        """:meth:`frame_now`; with ``trust_drained``, no read after one that emptied the socket."""
        unread = self._unread
        if unread is not None:
            self._unread = None
            return unread
        budget = _READ_BUDGET
        stream = self._in
        while True:
            if self._fd is None:
                return None
            frame = stream.next_frame()
            if frame is not None:
                return frame
            if stream.stopped:
                return None
            if trust_drained and self._drained:
                # The last read emptied the socket: another would most likely
                # find nothing, so wait for readiness (a wasted read is a
                # system call per message).
                return False
            if budget <= 0:
                self._budget_spent = True
                return False
            try:
                size = stream.read()
            except BlockingIOError:
                self._drained = True
                return False
            budget -= size
            self._drained = size > 0 and stream.drained

    def queue_frame(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        """Add a frame, whole, to the outgoing queue; a copy of ``fd`` goes with it."""
        self._out.add(kind, payload, fd, prefix)

    @property
    def queued(self) -> int:
        """Bytes queued and not yet written."""
        return self._out.queued

    def write_some(self) -> bool:
        """Write what the socket takes now; True once nothing is queued.

        Raises:
            BrokenPipeError: The rank's end is closed.
        """
        fd = self._fd
        if fd is None:
            raise BrokenPipeError("the channel was released")
        return self._out.write_some(fd)

    async def wait_writable(self) -> None:
        """Wait until the socket takes more."""
        fd = self._fd
        if fd is None:
            return
        with contextlib.suppress(anyio.ClosedResourceError):  # released meanwhile
            await anyio.wait_writable(fd)

    def close(self) -> None:
        """Close our end, waking a task that waits on it."""
        self._unwatch()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # it finds the link closed
        fd, self._fd = self._fd, None
        self._out.clear()
        self._unread = None
        self._in.forget()
        if fd is not None:
            # Shut down first: under fork, a sibling rank holds a copy of this
            # end until it has dropped the supervisor's descriptors, and
            # close() alone would leave the rank's end open that long (its
            # send() would not fail, nor its receive() see the end).
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # the rank's end is gone already
                pass
            finally:
                sock.detach()
            _pipes.close_watched(fd)
