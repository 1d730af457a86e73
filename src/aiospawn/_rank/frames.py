"""A rank's end of its channel's socket: frames queued and written, read and sorted by kind.

:class:`Frames` is what the rank's blocking ``channel.Channel`` and awaited
``async_channel.AsyncChannel`` take their frames through (they differ only in
how they wait): its :class:`~.stream.FrameQueue` holds the frames going out,
each whole, and its :class:`~.stream.FrameStream` reads the supervisor's,
which it sorts as they complete (messages, calls and cancels, the end). A
pooled segment's RELEASED frame is queued from the mapping's finalizer, in
whichever thread drops it, without waiting for the queue's lock; so is the
TAKEN frame that tells the supervisor a frame with a memfd was taken, which
its back-pressure waits for.

The rank opens it before ``fn`` (:func:`open_channel`: ``process`` for a
local rank, the actor for a Ray rank), and ends it after (:func:`finish`,
through ``api.end``).

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import os
import select
import time

from . import buffers
from .fds import identity
from .stream import FrameQueue, FrameStream
from .wire import TO_RANK, FrameError, Link, Payload, call_id_of

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .buffers import Packed


class Frames:
    """The rank's socket end: frames queued to write, frames read and sorted by kind.

    With ``shares_memory`` (a local rank's Unix socket, on Linux), frames may
    carry a memfd both ways (``buffers``).
    """

    def __init__(self, fd: int, shares_memory: bool = False) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._identity = identity(fd)
        self._out = FrameQueue()
        #: Large buffers sent from here go through a memfd.
        self.shares_memory = shares_memory and buffers.AVAILABLE
        #: RELEASED and TAKEN frames not yet queued: ``(kind, payload)``.
        self._notes: collections.deque[tuple[int, bytes]] = collections.deque()
        # Guards the outgoing queue: a release is queued from whichever
        # thread the garbage collector drops a mapping in.
        self._queue_lock = _thread.allocate_lock()
        self._pid = os.getpid()
        self._in = FrameStream(TO_RANK, self.shares_memory, fd, self.release_mapping)
        self._poller: Any = None  # made by the first blocking wait, then kept
        self.messages: collections.deque[Payload] = collections.deque()
        self.calls: collections.deque[Payload] = collections.deque()
        #: The ids of calls the supervisor cancelled after ``serve()`` took them.
        self.cancels: collections.deque[int] = collections.deque()
        #: Held by a thread of a sync rank while it queues and writes a frame.
        self.sending = _thread.allocate_lock()
        #: True once the supervisor closed its end (a CLOSE frame, or end of file).
        self.peer_closed = False
        #: What was wrong with a frame that broke the format, if one did.
        self.broken: str | None = None
        self.closed = False

    def queue(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        self._check_open()
        with self._queue_lock:
            self._queue_notes()
            self._out.add(kind, payload, fd, prefix)
        self._send_notes()

    def release_mapping(self, token: int) -> None:
        """Tell the supervisor a pooled segment is unmapped here (a RELEASED frame).

        Called by a mapping's finalizer, in whichever thread the last object
        that used it went, perhaps one that holds the queue's lock right now
        (the collector runs anywhere): so it never waits for the lock. If
        the lock is taken, the token waits, and goes out with the next frame
        queued or written.
        """
        self._note(Link.RELEASED, buffers.TOKEN.pack(token))

    def _note(self, kind: int, payload: bytes) -> None:
        """Queue a RELEASED or TAKEN frame now if the queue's lock is free, else with the next."""
        if self.closed or os.getpid() != self._pid:  # a child forked by fn holds no claim
            return
        self._notes.append((kind, payload))
        self._send_notes()

    def _send_notes(self) -> None:
        """Queue and write the waiting notes, if nobody holds the queue's lock."""
        while self._notes and self._queue_lock.acquire(False):
            try:
                if self.closed:  # checked under the lock: the descriptor is still ours
                    self._notes.clear()
                    return
                self._queue_notes()
                with contextlib.suppress(OSError):  # the supervisor is gone: nobody waits
                    self._out.write_some(self.fd)
            finally:
                self._queue_lock.release()

    def _queue_notes(self) -> None:
        """Move the waiting notes into the queue (the queue's lock is held)."""
        while self._notes:
            self._out.add(*self._notes.popleft())

    def queue_packed(self, kind: int, packed: Packed) -> None:
        """Queue ``packed`` as a ``kind`` frame, and close its memfd (the queue has a copy)."""
        try:
            self.queue(kind | packed.flag, packed.body, packed.fd, packed.prefix)
        finally:
            packed.close()

    @property
    def unsent(self) -> bool:
        return self._out.queued > 0

    def write_some(self) -> bool:
        """Write what the socket takes now; True once nothing is left queued."""
        try:
            with self._queue_lock:
                self._queue_notes()
                done = self._out.write_some(self.fd)
        except BrokenPipeError:
            # The supervisor closed its end (or is gone): nothing written
            # could be read.
            with self._queue_lock:
                self._out.clear()
            self.peer_closed = True
            raise BrokenPipeError("the supervisor closed this rank's channel") from None
        # A release that came while the lock was held goes out now, not
        # with some later frame.
        self._send_notes()
        return done and not self.unsent

    def read_some(self) -> None:
        """Read what the socket holds now, sorting each complete frame by kind."""
        while True:
            self._sort_read()
            if self.peer_closed:
                return
            try:
                self._in.read()
            except BlockingIOError:
                return
            if self._in.drained:
                # It took all there was: another read would most likely find
                # nothing, and cost a system call per message.
                self._sort_read()
                return

    def _sort_read(self) -> None:
        """Sort every frame read and complete; note the stream's end, or a broken frame."""
        while not self.peer_closed:
            try:
                frame = self._in.next_frame()
            except FrameError as exc:  # nothing more can be read: as if closed
                self.broken = str(exc)
                self.peer_closed = True
                return
            if frame is None:
                if self._in.at_end:
                    self.peer_closed = True
                return
            self._sort(frame)

    def _sort(self, frame: tuple[int, Payload]) -> None:
        kind, payload = frame
        if kind == Link.MESSAGE:
            self.messages.append(payload)
        elif kind == Link.CALL:
            self.calls.append(payload)
        elif kind == Link.CANCEL:
            self._cancel(call_id_of(payload))
        elif kind == Link.CLOSE:
            self.peer_closed = True

    def _cancel(self, call_id: int) -> None:
        """The supervisor gave up on a call: drop it if it waits here, else tell ``serve()``."""
        for index, call in enumerate(self.calls):
            if call_id_of(call) == call_id:
                del self.calls[index]  # never started: nobody will run it
                self._taken(Link.CALL, call)
                return
        self.cancels.append(call_id)

    def pop(self, kept: collections.deque[Payload]) -> Payload:
        """The oldest frame of ``kept`` (``messages`` or ``calls``), taken: it is the caller's."""
        frame = kept.popleft()
        self._taken(Link.MESSAGE if kept is self.messages else Link.CALL, frame)
        return frame

    def _taken(self, kind: int, frame: Payload) -> None:
        if isinstance(frame, buffers.Mapped):  # it came with a memfd: the supervisor counts it
            self._note(Link.TAKEN, bytes((kind,)))

    def take(self, kept: collections.deque[Payload]) -> Payload | None:
        """The next frame of ``kept`` (``messages`` or ``calls``), or None: wait, then ask again.

        Reads what the socket holds now first, if nothing is kept. Blocking
        and awaited receives both take their frames through it, and differ
        only in how they wait.

        Raises:
            EOFError: The supervisor closed its end, and nothing of that kind is left.
            ConnectionError: A frame broke the channel's format, and nothing is left.
        """
        if not kept and not self.peer_closed:
            self.read_some()
        if kept:
            return self.pop(kept)
        if self.peer_closed:
            raise _end(self)
        return None

    def end(self) -> Exception:
        """What reading past the end of the supervisor's stream raises."""
        return _end(self)

    def wait(self, write: bool, deadline: float | None = None) -> None:
        """Block until the socket can be written (or read); at most until ``deadline``."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.fd, select.POLLIN)
        self._poller.modify(self.fd, select.POLLOUT if write else select.POLLIN)
        timeout = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        self._poller.poll(timeout)

    def flush(self, deadline: float | None = None) -> None:
        """Write everything queued, blocking; give up at ``deadline``."""
        while not self.write_some():
            if deadline is not None and time.monotonic() >= deadline:
                return
            self.wait(True, deadline)

    def close(self) -> None:
        if not self.closed:
            with self._queue_lock:  # a release being written finishes first
                self.closed = True
                self._out.clear()
            self.forget_socket()
            os.close(self.fd)

    def forget_socket(self) -> None:
        """Let go of the socket object without closing the descriptor; drop what is unread."""
        self._in.forget()

    def _check_open(self) -> None:
        if self.closed:
            raise OSError("this rank's channel is closed")


def _end(frames: Frames) -> Exception:
    """What a read past the end of the supervisor's stream raises."""
    if frames.broken is not None:
        return ConnectionError(
            f"this rank's channel is broken: the supervisor sent {frames.broken}"
        )
    return EOFError("the supervisor closed this rank's channel")


def finish(frames: Frames | None, patience: float) -> None:
    """At the rank's end: send what cancelled sends left queued (for ``patience`` s), close.

    Nothing is done if the rank's own code closed the socket (``os.closerange``):
    its number may hold another file of the rank's by now.
    """
    if frames is None or frames.closed:
        return
    if identity(frames.fd) != frames._identity:
        with frames._queue_lock:  # no release is written to the number's new file
            frames.closed = True
        frames.forget_socket()
        return
    if frames.unsent:
        with contextlib.suppress(OSError):
            frames.flush(time.monotonic() + patience)
    frames.close()


def open_channel(fd: int, shares_memory: bool = False) -> Frames:
    """The rank's frames over its socket end ``fd``.

    ``shares_memory``: the supervisor reads the socket with its descriptors
    (a local rank's), so large buffers may go through a memfd both ways.
    """
    return Frames(fd, shares_memory)
