"""A rank's end of its channel to the supervisor: messages, readiness and calls.

Each local rank gets one end of a private Unix socket pair, made with the
rank like its result pipe (no port, no path: nothing another process can
open). Frames go both ways, in the shape of the outcome frame (``wire``):
a kind byte, a length, a pickle. The kinds are :class:`~.wire.Link`'s.

- :class:`Channel`: ``send(obj)``, ``receive()``, iteration, ``close()``,
  blocking, for a sync rank. :class:`AsyncChannel`: the same, awaitable, on
  the rank's own event loop (asyncio or trio) for an ``async def fn``.
- :func:`~aiospawn._rank.api.ready` sends one READY frame.
- ``serve(handler)`` answers CALL frames with REPLY frames until the
  supervisor closes its end.

The two directions are independent streams. While a rank waits for one kind
of frame, frames of the other kinds that arrive are kept, in order: a message
that comes while ``serve()`` waits for a call is there for the next
``receive()``, a call that comes during ``receive()`` for the next ``serve()``.

Pickles are user code both ways: whatever pickling or unpickling raises,
``SystemExit`` and ``KeyboardInterrupt`` included, is that object's error
(``TypeError`` to send, ``pickle.UnpicklingError`` to receive; for a call,
its error sent back to the caller), never the end of the rank's ``serve()``.

Cancellation (async ranks): a frame is queued whole before its first byte is
written. A task cancelled while the socket is full leaves the rest of its
frame queued; it goes out before anything sent after it, and at the latest
when the rank ends. A cancelled ``receive()`` loses nothing: a frame read in
part stays in the reader until the next one.

Part of the rank-side package: standard library only. The event loop of an
async rank is imported by the bootstrap that runs it.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import os
import pickle
import select
import time

from . import wire
from .wire import (
    CALL_ID,
    TO_RANK,
    FrameError,
    FrameQueue,
    FrameReader,
    Link,
    describe,
    encode_exception,
    from_fn,
)

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from typing import Any

_READ_CHUNK = 256 * 1024


class _Frames:
    """The rank's socket end: frames queued to write, frames read and sorted by kind."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._identity = _identity(fd)
        self._out = FrameQueue()
        self._reader = FrameReader(TO_RANK)
        self.messages: collections.deque[bytes | bytearray] = collections.deque()
        self.calls: collections.deque[bytes | bytearray] = collections.deque()
        #: Held by a thread of a sync rank while it queues and writes a frame.
        self.sending = _thread.allocate_lock()
        #: True once the supervisor closed its end (a CLOSE frame, or end of file).
        self.peer_closed = False
        #: What was wrong with a frame that broke the format, if one did.
        self.broken: str | None = None
        self.closed = False

    def queue(self, kind: int, payload: bytes) -> None:
        self._check_open()
        self._out.add(kind, payload)

    @property
    def unsent(self) -> bool:
        return self._out.queued > 0

    def write_some(self) -> bool:
        """Write what the socket takes now; True once nothing is left queued."""
        try:
            return self._out.write_some(self.fd)
        except BrokenPipeError:
            # The supervisor closed its end (or is gone): nothing written
            # could be read.
            self._out.clear()
            self.peer_closed = True
            raise BrokenPipeError("the supervisor closed this rank's channel") from None

    def read_some(self) -> None:
        """Read what the socket holds now, sorting each complete frame by kind."""
        while not self.peer_closed:
            try:
                data = os.read(self.fd, min(self._reader.wanted, _READ_CHUNK))
            except BlockingIOError:
                return
            except ConnectionResetError:
                data = b""
            if not data:
                self.peer_closed = True
                return
            try:
                self._reader.feed(data)
            except FrameError as exc:  # nothing more can be read: as if closed
                self.broken = str(exc)
                self.peer_closed = True
                return
            frame = self._reader.frame()
            if frame is None:
                continue
            self._reader = FrameReader(TO_RANK)
            kind, payload = frame
            if kind == Link.MESSAGE:
                self.messages.append(payload)
            elif kind == Link.CALL:
                self.calls.append(payload)
            elif kind == Link.CLOSE:
                self.peer_closed = True

    def wait(self, write: bool, deadline: float | None = None) -> None:
        """Block until the socket can be written (or read); at most until ``deadline``."""
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT if write else select.POLLIN)
        timeout = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        poller.poll(timeout)

    def flush(self, deadline: float | None = None) -> None:
        """Write everything queued, blocking; give up at ``deadline``."""
        while not self.write_some():
            if deadline is not None and time.monotonic() >= deadline:
                return
            self.wait(True, deadline)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)

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


def decode(payload: bytes | bytearray | memoryview, what: str) -> Any:
    """Unpickle a frame's payload.

    Raises:
        pickle.UnpicklingError: It cannot be unpickled; its cause is what the
            unpickling raised, whatever it was (``SystemExit`` too).
    """
    try:
        return pickle.loads(payload)
    except BaseException as exc:  # the pickle's own code raised: its error, not the rank's end
        raise pickle.UnpicklingError(f"{what} cannot be unpickled: {_raised(exc)}") from exc


def _raised(exc: BaseException) -> str:
    """``"SystemExit: 3"``: what the pickle's own code raised."""
    name, text = type(exc).__qualname__, describe(exc)
    return name if text == name else f"{name}: {text}"


def _reply(call_id: int, ok: bool, value: Any) -> bytes:
    if ok:
        try:
            answer = pickle.dumps((True, value), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # a __reduce__ may raise SystemExit: still this answer's
            error: Exception = TypeError(
                f"the handler's return value cannot be pickled: {_raised(exc)}"
            )
            error.__cause__ = exc
            value = error
        else:
            try:
                wire.check_size(len(answer))
            except ValueError as exc:
                value = ValueError(f"the handler's return value cannot be sent: {exc}")
            else:
                return CALL_ID.pack(call_id) + answer
    return CALL_ID.pack(call_id) + pickle.dumps((False, encode_exception(value)))


def _split(call: bytes | bytearray) -> tuple[int, memoryview]:
    """``(call_id, request pickle)`` of a CALL frame (its size was checked as it was read)."""
    (call_id,) = CALL_ID.unpack_from(call)
    return call_id, memoryview(call)[CALL_ID.size :]


def _request(request: memoryview) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    method, args, kwargs = decode(request, "the call's method and arguments")
    return method, args, kwargs


def _lookup(handler: Any, method: str) -> Any:
    if not isinstance(method, str) or method.startswith("_"):
        raise AttributeError(f"serve() answers calls of public methods only, not {method!r}")
    return getattr(handler, method)


class Channel:
    """The rank's end of its channel, in a sync rank: blocking calls.

    Get it with ``aiospawn.channel()``. Safe to use from several threads:
    sends are serialised, and so are receives.
    """

    def __init__(self, frames: _Frames) -> None:
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
        payload = encode(obj)
        with self._sending:
            self._frames.queue(Link.MESSAGE, payload)
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

    def serve(self, handler: Any) -> None:
        """Answer the supervisor's ``ctx.call()`` with ``handler``'s methods until it closes.

        See ``aiospawn.serve``.
        """
        with self._receiving:
            while True:
                try:
                    call = self._next(self._frames.calls)
                except EOFError:
                    return
                call_id, request = _split(call)
                try:
                    method, args, kwargs = _request(request)
                    value, ok = _lookup(handler, method)(*args, **kwargs), True
                except Exception as exc:
                    value, ok = from_fn(exc), False
                with self._sending:
                    self._frames.queue(Link.REPLY, _reply(call_id, ok, value))
                    self._frames.flush()

    def close(self) -> None:
        """Tell the supervisor nothing more comes (its ``receive()`` ends), and close."""
        with self._sending:
            if not self._frames.closed:
                self._frames.queue(Link.CLOSE, b"")
                self._frames.flush()
                self._frames.close()

    def _next(self, kept: collections.deque[bytes | bytearray]) -> bytes | bytearray:
        frames = self._frames
        while True:
            frames._check_open()
            if kept:
                return kept.popleft()
            if frames.peer_closed:
                raise _end(frames)
            frames.read_some()
            if not kept and not frames.peer_closed:
                frames.wait(False)


class AsyncChannel:
    """The rank's end of its channel, in an ``async def fn``: awaitable calls.

    Get it with ``aiospawn.channel()``. One task at a time may send, and one
    may receive (or serve); a second gets RuntimeError.
    """

    def __init__(self, frames: _Frames, loop: str) -> None:
        self._frames = frames
        self._loop = loop
        self._sender: object | None = None
        self._receiver: object | None = None
        self._writing: Any = None  # the loop's Lock, made on first use

    async def send(self, obj: Any) -> None:
        """Send ``obj`` to the supervisor; waits while the channel is full.

        Raises:
            TypeError: ``obj`` cannot be pickled.
            ValueError: ``obj`` pickles to more than a frame carries (1 GiB).
            OSError: The channel was closed by this rank.

        Cancellation:
            The message is queued whole before it is written: if the task is
            cancelled meanwhile, what is left of it still goes out, first.
        """
        payload = encode(obj)
        self._claim("_sender", "send")
        try:
            self._frames.queue(Link.MESSAGE, payload)
            await self._flush()
        finally:
            self._sender = None

    async def receive(self) -> Any:
        """Wait for the next message from the supervisor and return it.

        Raises:
            EOFError: The supervisor closed its end and every message was received.
            pickle.UnpicklingError: The next message cannot be unpickled here
                (its cause says why); it is dropped, and the next call gets the
                one after it.
            OSError: The channel was closed by this rank.
        """
        self._claim("_receiver", "receive")
        try:
            payload = await self._next(self._frames.messages)
        finally:
            self._receiver = None
        return decode(payload, "a message from the supervisor")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while True:
            try:
                message = await self.receive()
            except EOFError:
                return
            yield message

    async def serve(self, handler: Any) -> None:
        """Answer the supervisor's calls with ``handler``'s methods (sync or async) until closed."""
        self._claim("_receiver", "serve")
        try:
            while True:
                try:
                    call = await self._next(self._frames.calls)
                except EOFError:
                    return
                call_id, request = _split(call)
                try:
                    method, args, kwargs = _request(request)
                    value = _lookup(handler, method)(*args, **kwargs)
                    if hasattr(value, "__await__"):
                        value = await value
                    ok = True
                except Exception as exc:
                    value, ok = from_fn(exc), False
                self._frames.queue(Link.REPLY, _reply(call_id, ok, value))
                await self._flush()
        finally:
            self._receiver = None

    async def aclose(self) -> None:
        """Tell the supervisor nothing more comes (its ``receive()`` ends), and close."""
        if not self._frames.closed:
            self._frames.queue(Link.CLOSE, b"")
            await self._flush()
            self._frames.close()

    def _claim(self, role: str, what: str) -> None:
        if getattr(self, role) is not None:
            raise RuntimeError(f"another task is already waiting in {what}() on this channel")
        setattr(self, role, object())

    async def _flush(self) -> None:
        if self._frames.write_some():
            return
        # One task at a time waits for the socket: a sender and serve()'s
        # replies can both be flushing, and two waiters on one fd are refused
        # by trio (BusyResourceError) and, in asyncio, the second add_writer()
        # replaces the first one's callback, which is then never woken. The
        # task that waits writes every queued frame, the others' too.
        if self._writing is None:
            if self._loop == "trio":
                import trio

                self._writing = trio.Lock()
            else:
                import asyncio

                self._writing = asyncio.Lock()
        async with self._writing:
            while not self._frames.write_some():
                await self._wait(write=True)

    async def _next(self, kept: collections.deque[bytes | bytearray]) -> bytes | bytearray:
        frames = self._frames
        while True:
            frames._check_open()
            if frames.unsent and self._sender is None:
                await self._flush()  # what a cancelled send left, first
            if kept:
                return kept.popleft()
            if frames.peer_closed:
                raise _end(frames)
            frames.read_some()
            if not kept and not frames.peer_closed:
                await self._wait(write=False)

    async def _wait(self, write: bool) -> None:
        fd = self._frames.fd
        if self._loop == "trio":
            import trio

            await (trio.lowlevel.wait_writable if write else trio.lowlevel.wait_readable)(fd)
            return
        import asyncio

        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        if write:
            loop.add_writer(fd, wake)
        else:
            loop.add_reader(fd, wake)
        try:
            await woken
        finally:
            if write:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)


def _end(frames: _Frames) -> Exception:
    """What a read past the end of the supervisor's stream raises."""
    if frames.broken is not None:
        return ConnectionError(
            f"this rank's channel is broken: the supervisor sent {frames.broken}"
        )
    return EOFError("the supervisor closed this rank's channel")


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def finish(frames: _Frames | None, patience: float) -> None:
    """At the rank's end: send what cancelled sends left queued (for ``patience`` s), close.

    Nothing is done if the rank's own code closed the socket (``os.closerange``):
    its number may hold another file of the rank's by now.
    """
    if frames is None or frames.closed:
        return
    if _identity(frames.fd) != frames._identity:
        frames.closed = True
        return
    if frames.unsent:
        with contextlib.suppress(OSError):
            frames.flush(time.monotonic() + patience)
    frames.close()


def open_channel(fd: int) -> _Frames:
    """The rank's frames over its socket end ``fd``."""
    return _Frames(fd)
