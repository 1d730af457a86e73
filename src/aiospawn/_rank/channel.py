"""A rank's end of its channel to the supervisor: messages, readiness and calls.

Each local rank gets one end of a private Unix socket pair, made with the
rank like its result pipe (no port, no path: nothing another process can
open). Frames go both ways, in the shape of the outcome frame (``wire``):
a kind byte, a length, a pickle. The kinds are :class:`~.wire.Link`'s.

- :class:`Channel`: ``send(obj)``, ``receive()``, iteration, ``close()``,
  blocking, for a sync rank. ``async_channel.AsyncChannel``: the same,
  awaitable, on the rank's own event loop (asyncio or trio) for an
  ``async def fn``, imported by such a rank alone. Both take their frames
  through one :class:`Frames`, and differ only in how they wait.
- :func:`~aiospawn._rank.api.ready` sends one READY frame.
- A large buffer the supervisor sent in one of its pooled segments
  (``buffers``) is given back with a RELEASED frame once the last object that
  uses its mapping goes: :meth:`Frames.release_mapping`, called by the
  mapping's finalizer in whichever thread drops it, never waits for the
  outgoing queue's lock (the thread may hold it).
- ``serve(handler)`` answers CALL frames with REPLY frames until the
  supervisor closes its end. A CANCEL frame names a call the supervisor no
  longer waits for: a call not yet started is dropped here, as the frame is
  read; one that runs is cancelled by an async rank's ``serve()``
  (``async_serve``), and runs to its end in a sync rank's.

The two directions are independent streams. While a rank waits for one kind
of frame, frames of the other kinds that arrive are kept, in order: a message
that comes while ``serve()`` waits for a call is there for the next
``receive()``, a call that comes during ``receive()`` for the next ``serve()``.

Pickles are user code both ways: whatever pickling or unpickling raises,
``SystemExit`` and ``KeyboardInterrupt`` included, is that object's error
(``TypeError`` to send, ``pickle.UnpicklingError`` to receive; for a call,
its error sent back to the caller), never the end of the rank's ``serve()``.

A frame is queued whole before its first byte is written, and one read in
part stays in the reader until the rest comes: what an async rank's
cancelled send or receive leaves is never lost (see ``async_channel``), and
goes out at the latest when the rank ends (:func:`finish`).

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import os
import pickle
import select
import time

from . import buffers, wire
from .buffers import Packed
from .fds import identity
from .stream import FrameQueue, FrameStream
from .wire import (
    CALL_ID,
    TO_RANK,
    FrameError,
    Link,
    Payload,
    after_call_id,
    call_id_of,
    describe,
    encode_exception,
    from_fn,
)

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any


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
        #: Tokens of pooled segments unmapped here and not yet queued (RELEASED).
        self._releases: collections.deque[int] = collections.deque()
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

    def queue(self, kind: int, payload: bytes, fd: int = -1) -> None:
        self._check_open()
        with self._queue_lock:
            self._queue_releases()
            self._out.add(kind, payload, fd)
        self._send_releases()

    def release_mapping(self, token: int) -> None:
        """Tell the supervisor a pooled segment is unmapped here (a RELEASED frame).

        Called by a mapping's finalizer, in whichever thread the last object
        that used it went, perhaps one that holds the queue's lock right now
        (the collector runs anywhere): so it never waits for the lock. If
        the lock is taken, the token waits, and goes out with the next frame
        queued or written.
        """
        if self.closed or os.getpid() != self._pid:  # a child forked by fn holds no claim
            return
        self._releases.append(token)
        self._send_releases()

    def _send_releases(self) -> None:
        """Queue and write the waiting releases, if nobody holds the queue's lock."""
        while self._releases and self._queue_lock.acquire(False):
            try:
                if self.closed:  # checked under the lock: the descriptor is still ours
                    self._releases.clear()
                    return
                self._queue_releases()
                with contextlib.suppress(OSError):  # the supervisor is gone: nobody waits
                    self._out.write_some(self.fd)
            finally:
                self._queue_lock.release()

    def _queue_releases(self) -> None:
        """Move the waiting releases into the queue (the queue's lock is held)."""
        while self._releases:
            token = self._releases.popleft()
            self._out.add(Link.RELEASED, buffers.TOKEN.pack(token))

    def queue_packed(self, kind: int, packed: Packed) -> None:
        """Queue ``packed`` as a ``kind`` frame, and close its memfd (the queue has a copy)."""
        try:
            self.queue(kind | packed.flag, packed.body, packed.fd)
        finally:
            packed.close()

    @property
    def unsent(self) -> bool:
        return self._out.queued > 0

    def write_some(self) -> bool:
        """Write what the socket takes now; True once nothing is left queued."""
        try:
            with self._queue_lock:
                self._queue_releases()
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
        self._send_releases()
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
                return
        self.cancels.append(call_id)

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
            return kept.popleft()
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


def encode(obj: Any) -> bytes:
    """Pickle ``obj`` for a frame.

    Raises:
        TypeError: ``obj`` cannot be pickled (whatever its pickling raised,
            ``SystemExit`` included, is the cause).
        ValueError: Its pickle is larger than a frame carries.
    """
    try:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # a __reduce__ may raise SystemExit: still obj's error
        error = TypeError(f"cannot send {type(obj).__qualname__} over the channel: {_raised(exc)}")
        raise error from exc
    wire.check_size(len(payload))
    return payload


def pack(obj: Any, shared: bool) -> Packed:
    """Pickle ``obj`` for a frame; with ``shared``, its large buffers go into a memfd.

    Raises:
        TypeError: ``obj`` cannot be pickled (whatever its pickling raised,
            ``SystemExit`` included, is the cause).
        ValueError: Its pickle is larger than a frame carries.
        OSError: No memory for the memfd.
    """
    if not shared:
        return Packed(encode(obj))
    large: list[memoryview] = []
    try:
        body = buffers.pickle_body(obj, large)
    except BaseException as exc:  # a __reduce__ may raise SystemExit: still obj's error
        error = TypeError(f"cannot send {type(obj).__qualname__} over the channel: {_raised(exc)}")
        raise error from exc
    wire.check_size(len(body))
    return buffers.pack(body, large) if large else Packed(body)


def decode(payload: Payload | memoryview, what: str) -> Any:
    """Unpickle a frame's payload (with its mapped buffers, for a shared frame).

    Raises:
        pickle.UnpicklingError: It cannot be unpickled; its cause is what the
            unpickling raised, whatever it was (``SystemExit`` too).
    """
    try:
        return buffers.loads(payload)
    except BaseException as exc:  # the pickle's own code raised: its error, not the rank's end
        raise pickle.UnpicklingError(f"{what} cannot be unpickled: {_raised(exc)}") from exc


def _raised(exc: BaseException) -> str:
    """``"SystemExit: 3"``: what the pickle's own code raised."""
    name, text = type(exc).__qualname__, describe(exc)
    return name if text == name else f"{name}: {text}"


def reply(call_id: int, ok: bool, value: Any, shared: bool = False) -> Packed:
    """The REPLY frame to call ``call_id``: ``value``, or the exception raised.

    A value that cannot be pickled or sent is replied as the error that says
    so. With ``shared``, the value's large buffers go into a memfd.
    """
    if ok:
        try:
            packed = pack((True, value), shared)
        except TypeError as exc:  # pack()'s, whose cause is what the pickling raised
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            value = TypeError(f"the handler's return value cannot be pickled: {_raised(cause)}")
            value.__cause__ = cause
        except ValueError as exc:
            value = ValueError(f"the handler's return value cannot be sent: {exc}")
        except OSError as exc:
            value = OSError(f"the handler's return value cannot be sent: {exc}")
        else:
            return packed.prefixed(CALL_ID.pack(call_id))
    return Packed(CALL_ID.pack(call_id) + pickle.dumps((False, encode_exception(value))))


def _split(call: Payload) -> tuple[int, memoryview | bytes | buffers.Mapped]:
    """``(call_id, request pickle)`` of a CALL frame (its size was checked as it was read)."""
    return call_id_of(call), after_call_id(call)


def _request(
    request: memoryview | bytes | buffers.Mapped,
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    method, args, kwargs = decode(request, "the call's method and arguments")
    return method, args, kwargs


def _lookup(handler: Any, method: str) -> Any:
    if not isinstance(method, str) or method.startswith("_"):
        raise AttributeError(f"serve() answers calls of public methods only, not {method!r}")
    return getattr(handler, method)


def answer(handler: Any, call: Payload) -> tuple[int, bool, Any]:
    """``(call_id, ok, value)``: ``handler``'s answer to a CALL frame, or what it raised.

    The value of an ``async def`` method is its coroutine, which an async
    rank's ``serve()`` then awaits.
    """
    call_id, request = _split(call)
    try:
        method, args, kwargs = _request(request)
        return call_id, True, _lookup(handler, method)(*args, **kwargs)
    except Exception as exc:
        return call_id, False, from_fn(exc)


class Channel:
    """The rank's end of its channel, in a sync rank: blocking calls.

    Get it with ``aiospawn.channel()``. Safe to use from several threads:
    sends are serialised, and so are receives.
    """

    def __init__(self, frames: Frames) -> None:
        self._frames = frames
        self._sending = frames.sending
        self._receiving = _thread.allocate_lock()

    def send(self, obj: Any) -> None:
        """Send ``obj`` (pickled) to the supervisor; blocks while the channel is full.

        Raises:
            TypeError: ``obj`` cannot be pickled.
            ValueError: ``obj`` pickles to more than a frame carries (1 GiB).
            BrokenPipeError: The supervisor closed its end (``aclose()``).
            OSError: The channel was closed by this rank.
        """
        packed = pack(obj, self._frames.shares_memory)
        with self._sending:
            self._frames.queue_packed(Link.MESSAGE, packed)
            self._frames.flush()

    def receive(self) -> Any:
        """Wait for the next message from the supervisor and return it.

        Raises:
            EOFError: The supervisor closed its end and every message was received.
            pickle.UnpicklingError: The next message cannot be unpickled here
                (its cause says why); it is dropped, and the next call gets the
                one after it.
            OSError: The channel was closed by this rank.
        """
        with self._receiving:
            return decode(self._next(self._frames.messages), "a message from the supervisor")

    def __iter__(self) -> Iterator[Any]:
        """Yield messages until the supervisor closes its end."""
        while True:
            try:
                yield self.receive()
            except EOFError:
                return

    def serve(self, handler: Any, *, limit: int | None = None) -> None:
        """Answer the supervisor's ``ctx.call()`` with ``handler``'s methods until it closes.

        One call at a time, whatever ``limit``: a handler cannot be interrupted
        here, so a CANCEL only drops a call not yet started. See ``aiospawn.serve``.
        """
        check_limit(limit)
        frames = self._frames
        with self._receiving:
            while True:
                # What came meanwhile, so that a call kept here and cancelled
                # while the previous one ran is dropped, not run. (With none
                # kept, the wait for the next call reads first anyway.)
                if frames.calls and not frames.closed:
                    frames.read_some()
                frames.cancels.clear()  # of calls that have run: nothing to stop
                try:
                    call = self._next(frames.calls)
                except EOFError:
                    return
                call_id, ok, value = answer(handler, call)
                # Neither the call nor its answer is held while the next call
                # is awaited: a mapped buffer lives as long as its users.
                del call
                packed = reply(call_id, ok, value, frames.shares_memory)
                del value
                with self._sending:
                    self._frames.queue_packed(Link.REPLY, packed)
                    self._frames.flush()

    def close(self) -> None:
        """Tell the supervisor nothing more comes (its ``receive()`` ends), and close."""
        with self._sending:
            if not self._frames.closed:
                self._frames.queue(Link.CLOSE, b"")
                self._frames.flush()
                self._frames.close()

    def _next(self, kept: collections.deque[Payload]) -> Payload:
        frames = self._frames
        while True:
            frames._check_open()
            frame = frames.take(kept)
            if frame is not None:
                return frame
            frames.wait(False)


def check_limit(limit: int | None) -> None:
    """Refuse a ``serve(limit=...)`` that is neither None nor a positive int.

    Raises:
        TypeError: It is not an int.
        ValueError: It is below 1.
    """
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be a positive int or None, got {limit!r}")
    if limit < 1:
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")


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
