"""A channel's socket as frames, at either end: queued whole and written, read in bulk.

:class:`FrameQueue` holds the frames waiting to be written, each whole, a
frame's memfd descriptor beside its first bytes (``SCM_RIGHTS``).
:class:`FrameStream` reads what the socket holds in one call and hands out
the frames it completes, each through a ``reader.FrameReader``. The frames'
format is ``wire``'s.

The rank's end of its channel uses them (``frames.Frames``), and so does the
supervisor's end of a local rank's channel (``aiospawn._local._link``).

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import collections
import os

from .buffers import SHARED
from .reader import FrameReader
from .wire import HEADER, FrameError

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import Payload


#: A payload up to this size is copied behind its header and written with it.
JOIN_BYTES = 64 * 1024


class FrameQueue:
    """Frames waiting to be written to a non-blocking descriptor, each queued whole.

    Both ends of a channel write through one: the rank (``_rank.frames``) and
    the supervisor (``_local._link``). A frame may carry a descriptor (a
    memfd, see ``buffers``): it is sent with the frame's first bytes.
    """

    def __init__(self) -> None:
        # Each part with the descriptor that goes with its first byte, or -1.
        self._out: collections.deque[tuple[memoryview, int]] = collections.deque()
        #: Bytes queued and not yet written.
        self.queued = 0

    def add(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        """Queue one frame, whole; with ``fd``, a copy of it goes with the frame.

        The frame's payload is ``prefix`` then ``payload``; a large ``payload``
        is queued as it is, never copied (the same one may be queued for
        several ranks). The caller keeps ``fd``: the queue holds a duplicate
        until it is sent (or dropped by :meth:`clear`).
        """
        head = HEADER.pack(kind, len(prefix) + len(payload)) + prefix
        sent = -1 if fd < 0 else os.dup(fd)
        if len(payload) <= JOIN_BYTES:
            # One write, not two: a header written alone wakes the reader,
            # which then waits again for the payload.
            self._out.append((memoryview(head + payload), sent))
        else:
            self._out.append((memoryview(head), sent))
            self._out.append((memoryview(payload), -1))
        self.queued += len(head) + len(payload)

    def write_some(self, fd: int) -> bool:
        """Write what ``fd`` takes now; True once nothing is left queued.

        Raises:
            BrokenPipeError: The other end is closed (a reset reads as this too).
        """
        while self._out:
            head, passed = self._out[0]
            try:
                written = os.write(fd, head) if passed < 0 else _send_with(fd, head, passed)
            except BlockingIOError:
                return False
            except ConnectionResetError as exc:
                raise BrokenPipeError(str(exc)) from exc
            if passed >= 0:
                os.close(passed)  # it went with the bytes just written
            self.queued -= written
            if written == len(head):
                self._out.popleft()
            else:
                self._out[0] = (head[written:], -1)
        return True

    def clear(self) -> None:
        """Drop everything queued (closing the descriptors that were to go with it)."""
        for _, passed in self._out:
            if passed >= 0:
                os.close(passed)
        self._out.clear()
        self.queued = 0


def _send_with(fd: int, data: memoryview, passed: int) -> int:
    """Write ``data`` to the socket ``fd`` with the descriptor ``passed`` (``SCM_RIGHTS``)."""
    import array
    import socket

    sock = socket.socket(fileno=fd)
    try:
        rights = array.array("i", [passed])
        return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
    finally:
        sock.detach()


#: Room for this many descriptors per read: one is all a frame brings, and
#: more, from a rank that breaks the format, are closed by the kernel (their
#: read is flagged as cut short) or by the reader.
_FDS_PER_READ = 4

#: The most a :class:`FrameStream` reads in one call (its buffer's largest size) ...
READ_BYTES = 256 * 1024
#: ... and its buffer's first size.
_FIRST_READ_BYTES = 16 * 1024


class FrameStream:
    """The frames read off a channel's socket, each read taking all it holds (up to a bound).

    Both ends of a channel read through one: the rank (``_rank.frames``) and
    the supervisor (``_local._link``). One ``recvmsg`` (or ``read``) per call
    of :meth:`read` into a buffer kept for the stream's life, however many
    frames it holds: a small message costs one system call to read, not one
    for its header, one for its payload and one that finds nothing more.

    Descriptors (``shares_memory``): a sender passes a frame's descriptor with
    the frame's first bytes (:class:`FrameQueue`), and Linux ends a read of a
    Unix stream socket once it has taken descriptors, which come with the first
    bytes of the write that carried them. So the descriptors a read returns
    belong to the last frame that starts in it, or, if none starts in it (a
    sender that breaks the format), to the frame it continues, which then
    fails its check (``FrameReader.shared_frame``).

    A header that breaks the format stops the stream: the frames completed
    before it are still handed out, then :meth:`next_frame` raises.

    Args:
        sizes: The kinds this end accepts (``wire.FROM_RANK``, ``wire.TO_RANK``).
        shared: Frames may carry a memfd: reads take descriptors.
        fd: The socket's descriptor; the stream never closes it.
        release: Given to each frame's reader (:class:`FrameReader`): called
            with a pooled segment's token once its mapping is gone; None
            refuses pooled segments.
    """

    def __init__(
        self,
        sizes: dict[int, tuple[int, int | None]],
        shared: bool,
        fd: int,
        release: Any = None,
    ) -> None:
        self._sizes = sizes
        self._shared = shared
        self._release = release
        self._fd = fd
        self._sock: Any = None
        if shared:
            import socket

            # For recvmsg_into(); it never closes the descriptor (see forget()).
            self._sock = socket.socket(fileno=fd)
            self._sock.setblocking(False)
        # Made by the first read, small, and grown once a read fills it: a
        # rank that never uses its channel, or sends small messages, does
        # not pay for 256 KiB of fresh pages at its start.
        self._view = memoryview(bytearray(0))
        #: True if the last read took less than the buffer holds: the socket was
        #: emptied, and another read would most likely find nothing.
        self.drained = True
        #: The frame read in part, across reads.
        self._reader = FrameReader(sizes, shared, release)
        self._complete: collections.deque[FrameReader | tuple[int, bytes]] = collections.deque()
        self._error: FrameError | None = None
        #: True once the other end closed (or reset) the stream.
        self.at_end = False

    def __del__(self) -> None:
        # Only the socket object: it must never close the descriptor it borrows.
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.detach()

    def forget(self) -> None:
        """Let go of the socket object without closing the descriptor; drop what is unread."""
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.detach()
            self._sock = None
        if hasattr(self, "_complete"):
            for frame in self._complete:
                if isinstance(frame, FrameReader):
                    frame.discard()
            self._complete.clear()
            self._reader.discard()

    @property
    def pending(self) -> bool:
        """True if a frame (or the error that stopped the stream) waits to be taken."""
        return bool(self._complete) or self._error is not None

    @property
    def stopped(self) -> bool:
        """True once nothing more will be read: the end of the stream, or a broken header."""
        return self.at_end or self._error is not None

    def read(self) -> int:
        """Read what the socket holds now (one call); return the bytes read, 0 at the end.

        Raises:
            BlockingIOError: Nothing to read now.
        """
        view = self._view
        if not view or (not self.drained and len(view) < READ_BYTES):
            # The first read, or the last one filled the buffer: more may come at once.
            view = self._view = memoryview(bytearray(max(4 * len(view), _FIRST_READ_BYTES)))
        fds: list[int] = []
        try:
            if self._sock is None:
                size = os.readv(self._fd, [view])
            else:
                size, ancillary, flags, _ = self._sock.recvmsg_into(
                    [view], _ANCILLARY_SPACE, _CLOEXEC
                )
                for level, kind, data in ancillary:
                    if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
                        usable = len(data) - len(data) % 4
                        fds.extend(memoryview(data)[:usable].cast("i"))
                if flags & _CTRUNC:
                    fds.append(-1)  # more than a frame brings: the frame is refused
        except ConnectionResetError:  # the other end exited with our frames unread
            size = 0
        if not size:
            self.at_end = True
            self._close_fds(fds)
            return 0
        self.drained = size < len(view)
        self._split(view[:size], fds)
        return size

    def next_frame(self) -> tuple[int, Payload] | None:
        """The next complete frame, or None.

        Raises:
            FrameError: The frame (or the header after the frames taken) breaks
                the format; nothing more comes from this stream.
        """
        while self._complete:
            frame = self._complete.popleft()
            if isinstance(frame, tuple):
                return frame
            try:
                done = frame.shared_frame()
            except FrameError as exc:
                self._stop(exc)
                break
            assert done is not None
            return done
        if self._error is not None:
            raise self._error
        return None

    def _split(self, data: memoryview, fds: list[int]) -> None:
        """Sort ``data`` into frames; ``fds`` go to the last frame that starts in it."""
        if self._error is not None:
            self._close_fds(fds)
            return
        end = len(data)
        pos = 0
        owner = self._reader if self._reader.started else None  # the frame continued here
        started: FrameReader | tuple[int, bytes] | None = None
        header_size = HEADER.size
        while pos < end:
            reader = self._reader
            if not reader.started and end - pos >= header_size:
                # The common case: a whole header here, its payload maybe too.
                kind, size = HEADER.unpack_from(data, pos)
                try:
                    reader.check(kind, size)
                except FrameError as exc:
                    self._close_fds(fds)
                    self._break(exc)
                    return
                if end - pos - header_size >= size and not kind & SHARED:
                    started = (kind, bytes(data[pos + header_size : pos + header_size + size]))
                    self._complete.append(started)
                    pos += header_size + size
                    continue
            if not reader.started:
                started = reader
            taken = min(reader.wanted, end - pos)
            try:
                reader.feed(data[pos : pos + taken])
            except FrameError as exc:
                self._close_fds(fds)
                self._break(exc)
                return
            pos += taken
            if reader.complete:
                self._complete.append(reader)
                self._reader = FrameReader(self._sizes, self._shared, self._release)
        if fds:
            target = started if started is not None else owner
            if isinstance(target, FrameReader):
                target.add_fds(fds)
            elif target is None:
                self._reader.add_fds(fds)
            else:  # a whole frame without the SHARED flag: the descriptors make it break
                assert self._complete[-1] is target  # no frame starts after it
                self._complete.pop()
                broken = FrameReader(self._sizes, self._shared, self._release)
                broken.feed(HEADER.pack(target[0], len(target[1])) + target[1])
                broken.add_fds(fds)
                self._complete.append(broken)

    def _break(self, error: FrameError) -> None:
        """A header broke the format: the frames before it are still handed out, then ``error``."""
        self._error = error
        self._reader.discard()

    def _stop(self, error: FrameError) -> None:
        """A frame broke the format: nothing past it is handed out."""
        self._error = error
        self._reader.discard()
        for frame in self._complete:
            if isinstance(frame, FrameReader):
                frame.discard()
        self._complete.clear()

    @staticmethod
    def _close_fds(fds: list[int]) -> None:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _socket_constants() -> tuple[int, int, int, int, int]:
    """``(ancillary space, MSG_CMSG_CLOEXEC, MSG_CTRUNC, SOL_SOCKET, SCM_RIGHTS)``, or zeros."""
    try:
        import socket

        # Plain ints: the enums' operators cost microseconds per read.
        return (
            socket.CMSG_SPACE(_FDS_PER_READ * 4),
            int(socket.MSG_CMSG_CLOEXEC),
            int(socket.MSG_CTRUNC),
            int(socket.SOL_SOCKET),
            int(socket.SCM_RIGHTS),
        )
    except (ImportError, AttributeError):  # no descriptor passing here: never used
        return 0, 0, 0, 0, 0


_ANCILLARY_SPACE, _CLOEXEC, _CTRUNC, _SOL_SOCKET, _SCM_RIGHTS = _socket_constants()
