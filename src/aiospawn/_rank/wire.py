"""What a rank and its supervisor agree on: the outcome frame and a few constants.

How ``fn`` ended travels as one frame, which a rank writes on its private pipe
just before it exits (after an ENDED frame that says when ``fn`` ended)::

    +----------+------------------+---------------------+
    | kind: 1B | size: 8B, big-end | payload: size bytes |
    +----------+------------------+---------------------+

The frame carries its own length, so the supervisor knows when it is complete
without waiting for end-of-file: a grandchild that inherited the pipe's write
end would otherwise hold the supervisor up until it exits too.

The encoders are here too, beside the format they write, for every backend:
``outcome`` encodes how ``fn`` ended with them, then a local rank writes the
frame to its pipe, and a Ray rank hands it back from its actor call. The
supervisor decodes frames in ``aiospawn._core._outcome``.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import struct

from .buffers import LAYOUT, SHARED, TOKEN, Mapped, map_shared

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final


HEADER = struct.Struct("!BQ")
#: What CALL, REPLY and CANCEL payloads start with: the call's id, which pairs them.
CALL_ID = struct.Struct("!Q")

#: The payload of an ENDED frame: ``time.time()`` on the rank's clock when ``fn``
#: returned or raised. Wall-clock time, as for an exit the supervisor dates itself.
ENDED_AT = struct.Struct("!d")

#: The variable that holds a rank's restart count (see :func:`restart_count`).
RESTART_COUNT_VAR = "AIOSPAWN_RESTART_COUNT"

#: The signal on which a rank writes every thread's stack to the supervisor,
#: when the group watches heartbeats. A real-time signal: programs rarely use
#: them, unlike SIGUSR1 and SIGUSR2.
STACK_SIGNAL = signal.SIGRTMIN + 3

#: The exit status of a rank whose code closed the pipe it reports on (say, with
#: ``os.closerange``): how ``fn`` ended is lost, and a status of 0 would read as
#: success. (``timeout(1)`` and ``sysexits.h`` do not use it.)
LOST_CHANNEL_STATUS = 86

#: The size of a rank's heartbeat slot: a ``time.monotonic_ns()``, then a
#: word the rank sets to 1 once it answers :data:`STACK_SIGNAL` (before, the
#: signal's default action would end it).
BEAT_BYTES = 16


class Kind:
    """What a frame's payload holds (plain ints: an enum would cost every rank its set-up)."""

    #: ``pickle(value)``: ``fn`` returned, or called ``sys.exit()`` with 0 or None.
    RETURNED: Final = 1
    #: ``pickle((exception_pickle_or_None, type_name, traceback_text))``.
    RAISED: Final = 2
    #: ``pickle((exit_code, text_or_None))``: ``fn`` called ``sys.exit(n)``.
    EXITED: Final = 3
    #: :data:`ENDED_AT`: when ``fn`` ended; a local rank sends it just before its outcome.
    ENDED: Final = 4


class Link:
    """What a frame on a rank's channel holds (see ``aiospawn._rank.channel``).

    The channel carries frames of the same shape as the outcome frame, both ways.
    """

    #: ``pickle(obj)``: a message sent with ``send(obj)``.
    MESSAGE: Final = 1
    #: ``pickle(payload)``: the rank called ``aiospawn.ready(payload)``.
    READY: Final = 2
    #: :data:`CALL_ID`, then ``pickle((method, args, kwargs))``: a call of the rank's handler.
    CALL: Final = 3
    #: :data:`CALL_ID`, then ``pickle((True, value))``, or ``pickle((False, raised))``
    #: with a RAISED payload (:func:`encode_exception`): the handler's answer.
    REPLY: Final = 4
    #: Empty: the sender closed its end; nothing more comes from it.
    CLOSE: Final = 5
    #: :data:`CALL_ID` alone: the supervisor no longer waits for that call (it
    #: was cancelled or timed out); the rank cancels its handler, or drops the
    #: call if it has not started it.
    CANCEL: Final = 6
    #: ``buffers.TOKEN``: the rank has unmapped one frame's pooled segment
    #: (``buffers.POOLED``); the supervisor may rewrite it once nobody maps it.
    RELEASED: Final = 7


#: The largest payload of a channel frame, either way: 1 GiB. A sender refuses
#: a larger object (``ValueError``); a receiver reads a header that announces
#: more as a broken channel, and nothing of its payload. It bounds what a rank
#: whose channel carries garbage can make its supervisor buffer.
MAX_FRAME_BYTES = 1 << 30

#: ``kind: (smallest, largest payload)`` of the frames a rank may send on its
#: channel; ``None`` stands for :data:`MAX_FRAME_BYTES`. A REPLY starts with its
#: :data:`CALL_ID`; a CLOSE is empty. The kinds in :data:`SHARED_KINDS` may
#: carry the ``buffers.SHARED`` flag too.
FROM_RANK: dict[int, tuple[int, int | None]] = {
    Link.MESSAGE: (0, None),
    Link.READY: (0, None),
    Link.REPLY: (CALL_ID.size, None),
    Link.CLOSE: (0, 0),
    Link.RELEASED: (TOKEN.size, TOKEN.size),
}
#: The same, for the frames the supervisor may send to a rank: a CANCEL is its
#: :data:`CALL_ID` and nothing more.
TO_RANK: dict[int, tuple[int, int | None]] = {
    Link.MESSAGE: (0, None),
    Link.CALL: (CALL_ID.size, None),
    Link.CLOSE: (0, 0),
    Link.CANCEL: (CALL_ID.size, CALL_ID.size),
}

#: The kinds whose frames may carry a memfd (``buffers``), and whether their
#: payload starts with a :data:`CALL_ID` (before the layout).
SHARED_KINDS: dict[int, int] = {Link.MESSAGE: 0, Link.CALL: CALL_ID.size, Link.REPLY: CALL_ID.size}

_LINK_NAMES = {
    Link.MESSAGE: "MESSAGE",
    Link.READY: "READY",
    Link.CALL: "CALL",
    Link.REPLY: "REPLY",
    Link.CLOSE: "CLOSE",
    Link.CANCEL: "CANCEL",
    Link.RELEASED: "RELEASED",
}


class FrameError(ValueError):
    """A frame header that breaks the channel's format: an unknown kind, or a size out of range.

    Raised by :meth:`FrameReader.feed`; the stream cannot be read past it.
    """


def check_size(size: int) -> None:
    """Refuse to send a payload of ``size`` bytes beyond :data:`MAX_FRAME_BYTES`.

    Raises:
        ValueError: It is larger.
    """
    if size > MAX_FRAME_BYTES:
        raise ValueError(
            f"the pickle is {size} bytes, more than a channel frame carries"
            f" ({MAX_FRAME_BYTES} bytes): send it in parts, or through a file"
        )


#: A payload up to this size is copied behind its header and written with it.
JOIN_BYTES = 64 * 1024


class FrameQueue:
    """Frames waiting to be written to a non-blocking descriptor, each queued whole.

    Both ends of a channel write through one: the rank (``_rank.channel``) and
    the supervisor (``_local._link``). A frame may carry a descriptor (a
    memfd, see ``buffers``): it is sent with the frame's first bytes.
    """

    def __init__(self) -> None:
        # Each part with the descriptor that goes with its first byte, or -1.
        self._out: collections.deque[tuple[memoryview, int]] = collections.deque()
        #: Bytes queued and not yet written.
        self.queued = 0

    def add(self, kind: int, payload: bytes, fd: int = -1) -> None:
        """Queue one frame, whole; with ``fd``, a copy of it goes with the frame.

        The caller keeps ``fd``: the queue holds a duplicate until it is sent
        (or dropped by :meth:`clear`).
        """
        head = HEADER.pack(kind, len(payload))
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

    Both ends of a channel read through one: the rank (``_rank.channel``) and
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
        sizes: The kinds this end accepts (:data:`FROM_RANK`, :data:`TO_RANK`).
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


class ChildEnd:
    """A pipe end handed to a rank: a plain fd, duplicated into the rank when pickled.

    ``multiprocessing`` pickles a rank's arguments under ``spawn`` and
    ``forkserver``; there, the fd is passed with the process (its ``DupFd``
    mechanism), and the rank gets a ``ChildEnd`` of its own copy. Under ``fork``
    the object is inherited as it is. Unlike ``multiprocessing.connection``'s
    objects it costs the rank no imports.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _rebuild_child_end, (reduction.DupFd(self.fd),)

    def __repr__(self) -> str:
        return f"<ChildEnd fd={self.fd}>"


def _rebuild_child_end(duplicate: Any) -> ChildEnd:
    return ChildEnd(duplicate.detach())


def header(kind: int, size: int) -> bytes:
    """Return the header that precedes a payload of ``size`` bytes."""
    return HEADER.pack(kind, size)


def ended_frame(ended_at: float) -> bytes:
    """The whole ENDED frame that says ``fn`` ended at ``ended_at`` (``time.time()``)."""
    return HEADER.pack(Kind.ENDED, ENDED_AT.size) + ENDED_AT.pack(ended_at)


def read_ended(payload: bytes | bytearray) -> float | None:
    """The time an ENDED frame's payload holds, or None if it holds none."""
    if len(payload) != ENDED_AT.size:
        return None
    (ended_at,) = ENDED_AT.unpack(payload)
    return float(ended_at)


class FrameReader:
    """Reassembles one frame from the chunks read off the pipe.

    The payload grows in one buffer as chunks come, so that a large frame is
    never copied whole in one step (a join at its end, or zero-filling a
    buffer of its full size up front): the reader runs on the event loop.

    Args:
        sizes: The kinds this reader accepts, each with its payload's bounds
            (:data:`FROM_RANK`, :data:`TO_RANK`); ``None`` accepts any frame
            (the outcome frame, whose size only the rank's result bounds).
        shared: Frames may carry a memfd (``buffers.SHARED``), mapped as they complete.
        release: Called with a pooled segment's token once its mapping is
            gone (a rank's reader: see ``buffers.map_shared``); None refuses
            pooled segments (the supervisor's reader).
    """

    def __init__(
        self,
        sizes: dict[int, tuple[int, int | None]] | None = None,
        shared: bool = False,
        release: Any = None,
    ) -> None:
        self._sizes = sizes
        self._shared = shared
        #: Called with a pooled segment's token once its mapping is gone
        #: (``buffers.map_shared``); None refuses pooled segments.
        self._release = release
        self._header = bytearray()
        self._kind: int | None = None
        self._size = 0
        self._payload = bytearray()
        #: Descriptors received with this frame's bytes (-1: some were refused).
        self._fds: list[int] = []

    @property
    def complete(self) -> bool:
        """True once the whole frame has been fed."""
        return self._kind is not None and len(self._payload) >= self._size

    @property
    def started(self) -> bool:
        """True once any of the frame's bytes have been fed."""
        return self._kind is not None or bool(self._header)

    @property
    def at_header(self) -> bool:
        """True while the header is incomplete: the frame's descriptor comes with it."""
        return self._kind is None

    @property
    def wanted(self) -> int:
        """How many more bytes the frame needs (an upper bound before the header)."""
        if self._kind is None:
            return HEADER.size - len(self._header)
        return self._size - len(self._payload)

    def feed(self, data: bytes | memoryview) -> None:
        """Add bytes read from the pipe (at most :attr:`wanted` at a time).

        Raises:
            FrameError: The header completed by ``data`` is not one this reader
                accepts; the reader takes nothing more.
        """
        view = memoryview(data)
        if self._kind is None:
            taken = HEADER.size - len(self._header)
            self._header += view[:taken]
            view = view[taken:]
            if len(self._header) < HEADER.size:
                return
            kind, size = HEADER.unpack(self._header)
            if self._sizes is not None:
                self._check(kind, size)
            self._kind, self._size = kind, size
        self._payload += view

    def add_fds(self, fds: list[int]) -> None:
        """Descriptors that came with this frame's bytes; the reader closes them."""
        self._fds.extend(fds)

    def discard(self) -> None:
        """Close the descriptors of a frame that will never complete (the stream ended)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def check(self, kind: int, size: int) -> None:
        """Refuse a header this reader would refuse (see :meth:`feed`).

        Raises:
            FrameError: It breaks the format.
        """
        if self._sizes is not None:
            self._check(kind, size)

    def _check(self, kind: int, size: int) -> None:
        assert self._sizes is not None
        base = kind & ~SHARED
        if kind & SHARED and self._shared and base in SHARED_KINDS and base in self._sizes:
            start = SHARED_KINDS[base]
            if size < start + LAYOUT.size:
                raise FrameError(f"a shared frame of {size} bytes, too short for its layout")
            kind = base
        bounds = self._sizes.get(kind)
        if bounds is None:
            raise FrameError(
                f"a frame of unknown kind {kind} (its header: {HEADER.pack(kind, size).hex(' ')})"
            )
        low, high = bounds
        name = _LINK_NAMES[kind]
        if high == 0 and size != 0:
            raise FrameError(f"a {name} frame of {size} bytes (a {name} frame is empty)")
        if high == low and size != low:
            what = "token" if kind == Link.RELEASED else "call id"
            raise FrameError(
                f"a {name} frame of {size} bytes (a {name} frame is its {low}-byte {what})"
            )
        if size < low:
            raise FrameError(f"a {name} frame of {size} bytes, shorter than its {low}-byte call id")
        if size > (MAX_FRAME_BYTES if high is None else high):
            raise FrameError(
                f"a {name} frame of {size} bytes, more than a channel frame carries"
                f" ({MAX_FRAME_BYTES} bytes)"
            )

    def frame(self) -> tuple[int, bytes | bytearray] | None:
        """Return ``(kind, payload)`` once complete, else ``None``.

        The payload is the reader's own buffer, not a copy.
        """
        if not self.complete:
            return None
        assert self._kind is not None
        return self._kind, self._payload

    def shared_frame(self) -> tuple[int, Payload] | None:
        """:meth:`frame`, for a reader that takes descriptors (``shared``).

        A shared frame's payload is a ``buffers.Mapped`` (its memfd mapped,
        its descriptor closed), and its kind loses the ``SHARED`` flag.

        Raises:
            FrameError: A shared frame without a descriptor (or with a layout
                or memfd a sender does not make), or a frame with one it
                should not have. Every descriptor that came is closed.
        """
        if not self.complete:
            return None
        kind = self._kind
        assert kind is not None
        fds, self._fds = self._fds, []
        if not kind & SHARED:
            if fds:
                self._fds = fds
                self.discard()
                raise FrameError(f"a {_name(kind)} frame that came with a descriptor")
            return kind, self._payload
        try:
            if len(fds) != 1 or fds[0] < 0:
                count = "too many" if -1 in fds else len(fds)
                raise FrameError(
                    f"a shared {_name(kind & ~SHARED)} frame that came with {count}"
                    " descriptor(s), not one"
                )
            try:
                mapped = map_shared(
                    self._payload, SHARED_KINDS[kind & ~SHARED], fds[0], self._release
                )
            except (ValueError, OSError) as exc:
                raise FrameError(f"a broken shared {_name(kind & ~SHARED)} frame: {exc}") from None
        finally:
            self._fds = fds
            self.discard()
        return kind & ~SHARED, mapped


def _name(kind: int) -> str:
    return _LINK_NAMES.get(kind, f"kind {kind}")


#: What a frame's payload is: the reader's buffer, or a shared frame's mapping.
Payload = bytes | bytearray | Mapped


def call_id_of(payload: Payload) -> int:
    """The call id a CALL or REPLY payload starts with."""
    data = payload.pickle if isinstance(payload, Mapped) else payload
    return int(CALL_ID.unpack_from(data)[0])


def after_call_id(payload: Payload) -> bytes | memoryview | Mapped:
    """The pickle of a CALL or REPLY payload, past its call id (no copy of a large one)."""
    if isinstance(payload, Mapped):
        return payload.after(CALL_ID.size)
    return memoryview(payload)[CALL_ID.size :]


#: ``(kind, payload, exit_code)``: the frame a rank sends, and the exit code it then
#: has (the rule that makes it is ``outcome.run_fn``).
Outcome = tuple[int, bytes, int]


def encode_value(value: Any) -> Outcome:
    """The frame of a returned value, or of the TypeError if it cannot be pickled."""
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # a __reduce__ may raise SystemExit: still this frame
        error = TypeError(f"the value returned by the rank cannot be pickled: {describe(exc)}")
        error.__cause__ = exc
        return Kind.RAISED, encode_exception(error), 1
    return Kind.RETURNED, payload, 0


def encode_exit(exc: SystemExit) -> Outcome:
    """The frame of ``sys.exit(code)``: success for ``None`` and 0, else EXITED.

    The frame keeps the code as given; the exit status is :func:`exit_status` of it.
    """
    if exc.code is None or exc.code == 0:
        return encode_value(None)
    if isinstance(exc.code, int):
        code, text = int(exc.code), None
    else:
        code, text = 1, f"sys.exit({exc.code!r})"
    return Kind.EXITED, pickle.dumps((code, text)), exit_status(code)


def exit_status(code: int) -> int:
    """The status a rank exits with after ``sys.exit(code)``, ``code`` non-zero: 1 to 255.

    The kernel keeps the low 8 bits of a status, so ``sys.exit(256)`` would read
    as success, and ``os._exit()`` refuses codes beyond a C int. A code that
    does not fit exits with 1, and the frame carries the code itself.
    """
    return code if 0 < code < 256 else 1


def encode_exception(exc: BaseException, text: str | None = None) -> bytes:
    """The payload of a RAISED frame: the pickled exception if it pickles, its type, its text.

    ``text`` defaults to the formatted traceback of ``exc``.
    """
    type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    if text is None:
        import traceback

        try:
            text = "".join(traceback.format_exception(exc))
        except BaseException as failure:  # the exception's own code raised (__str__)
            text = f"{type_name} (its traceback cannot be formatted: {describe(failure)})\n"
    # Whatever the exception's own code raises while it is pickled, SystemExit
    # and KeyboardInterrupt included, the frame still goes out with the text:
    # otherwise the supervisor would see only "exit code 1".
    try:
        exc_pickle: bytes | None = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        exc_pickle = None
    return pickle.dumps((exc_pickle, type_name, text))


def describe(exc: BaseException) -> str:
    """``str(exc)``, or its type's name if even that raises."""
    try:
        return str(exc) or type(exc).__qualname__
    except BaseException:
        return f"<{type(exc).__qualname__}: str() failed>"


def from_fn(exc: BaseException) -> BaseException:
    """``exc`` with its traceback starting in the code it was raised from.

    Called where ``exc`` was caught: the catching frame (``outcome.run_fn``,
    a channel's ``serve()``) is ours, not the user's.
    """
    if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
        return exc.with_traceback(exc.__traceback__.tb_next)
    return exc
