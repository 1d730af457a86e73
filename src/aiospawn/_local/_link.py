"""A local rank's channel transport: one end of a Unix socket pair, read on the event loop.

The supervisor keeps one end (non-blocking), the rank gets the other (see
``aiospawn._rank.channel``); both are made with the rank, like its result
pipe, and recorded in the descriptor table a ``fork`` rank clears. Frames
whose large buffers are in a memfd carry its descriptor (``_rank.buffers``):
reads take descriptors with the bytes (``recvmsg``), and the reader hands
each to its frame.
"""

from __future__ import annotations

import contextlib
import os
import socket

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._rank import buffers
from aiospawn._rank.wire import FROM_RANK, ChildEnd, FrameQueue, FrameReader, Payload, receive

from . import _pipes

_READ_CHUNK = 256 * 1024
#: At most this much is read per wake-up, so that the loop runs other tasks between.
_READ_BUDGET = 1024 * 1024


def rank_socket() -> tuple[int, ChildEnd]:
    """Make a rank's channel: ``(our end, the rank's end)``, both close-on-exec."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return _pipes.track(ours.detach()), ChildEnd(_pipes.track(theirs.detach()))


class SocketLink:
    """The supervisor's end of one local rank's channel (see ``_core._channel.Link``)."""

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
        # For recvmsg(); it never closes the descriptor (detached in close()).
        self._sock = socket.socket(fileno=fd) if self.shares_memory else None
        if self._sock is not None:
            self._sock.setblocking(False)
        self._reader = FrameReader(FROM_RANK, self.shares_memory)
        self._budget_spent = False  # frame_now() stopped for the loop's sake, not for data
        self._out = FrameQueue()

    def __del__(self) -> None:
        # The socket object only borrows the descriptor, which close() (or
        # _pipes) closes: it must never close it itself, even unclosed.
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.detach()

    async def receive_frame(self) -> tuple[int, Payload] | None:
        """The next frame, or None at the end of the stream; cancellation-safe.

        Raises:
            FrameError: The rank sent a header that breaks the format.
        """
        while True:
            frame = self.frame_now()
            if frame is not False:
                assert frame is not True
                return frame
            if self._budget_spent:  # a large frame: let other tasks run between reads
                self._budget_spent = False
                await checkpoint()
                continue
            fd = self._fd
            if fd is None:
                return None
            try:
                await anyio.wait_readable(fd)
            except anyio.ClosedResourceError:  # released meanwhile
                return None

    def frame_now(self) -> tuple[int, Payload] | bool | None:
        """The next frame if it can be read without waiting; None at the end, else False.

        Raises:
            FrameError: The rank sent a header that breaks the format (checked
                as the header completes: none of its payload is read).
        """
        budget = _READ_BUDGET
        while budget > 0:
            fd = self._fd
            if fd is None:
                return None
            try:
                if self._sock is None:
                    data = os.read(fd, min(self._reader.wanted, _READ_CHUNK))
                else:
                    data = receive(self._sock, self._reader, _READ_CHUNK)
            except BlockingIOError:
                return False
            except ConnectionResetError:  # the rank exited with our frames unread
                data = b""
            if not data:
                return None
            self._reader.feed(data)
            frame = self._reader.shared_frame()
            if frame is not None:
                self._reader = FrameReader(FROM_RANK, self.shares_memory)
                return frame
            budget -= len(data)
        self._budget_spent = True
        return False

    def queue_frame(self, kind: int, payload: bytes, fd: int = -1) -> None:
        """Add a frame, whole, to the outgoing queue; a copy of ``fd`` goes with it."""
        self._out.add(kind, payload, fd)

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
        fd, self._fd = self._fd, None
        self._out.clear()
        self._reader.discard()
        if self._sock is not None:
            self._sock.detach()
            self._sock = None
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
