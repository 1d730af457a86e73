"""A rank's end of its channel to the supervisor: messages, readiness and calls.

Each local rank gets one end of a private Unix socket pair, made with the
rank like its result pipe (no port, no path: nothing another process can
open). Frames go both ways, in the shape of the outcome frame (``wire``):
a kind byte, a length, a pickle. The kinds are :class:`~.wire.Link`'s.

- :class:`Channel`: ``send(obj)``, ``receive()``, iteration, ``close()``,
  blocking, for a sync rank. ``async_channel.AsyncChannel``: the same,
  awaitable, on the rank's own event loop (asyncio or trio) for an
  ``async def fn``, imported by such a rank alone. Both take their frames
  through one ``frames.Frames``, and differ only in how they wait.
- :func:`~aiospawn._rank.api.ready` sends one READY frame.
- A large buffer the supervisor sent in one of its pooled segments
  (``buffers``) is given back with a RELEASED frame once the last object that
  uses its mapping goes: ``frames.Frames.release_mapping``, called by the
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
goes out at the latest when the rank ends (``frames.finish``).

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import _thread
import pickle
import types

from . import buffers, wire
from .buffers import Packed
from .wire import (
    CALL_ID,
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
    import collections
    from collections.abc import Iterator
    from typing import Any

    from .frames import Frames


def encode(obj: Any) -> bytes:
    """Pickle ``obj`` for a frame.

    Raises:
        TypeError: ``obj`` cannot be pickled (whatever its pickling raised,
            ``SystemExit`` included, is the cause).
        ValueError: Its pickle is larger than a frame carries.
    """
    try:
        payload = buffers.dumps_whole(obj)
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
    return Packed(pickle.dumps((False, encode_exception(value))), prefix=CALL_ID.pack(call_id))


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


def _awaitable_in_a_sync_rank(name: str) -> TypeError:
    return TypeError(
        f"{name} is an async def method, and this rank's serve() runs none: a sync"
        " rank calls handler methods without an event loop. Make the method a plain"
        " def, or make fn an async def that awaits aiospawn.serve(handler)"
    )


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
                if ok and isinstance(value, types.CoroutineType):
                    value.close()  # never to be awaited here: closed, it does not warn
                    ok, value = False, _awaitable_in_a_sync_rank(value.__qualname__)
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
