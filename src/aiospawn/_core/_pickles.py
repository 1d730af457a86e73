"""Pickling what the supervisor and its ranks exchange: off the loop when large.

Pickles are user code both ways (a ``__reduce__``, a class's module import):
whatever it raises, ``SystemExit`` and ``KeyboardInterrupt`` included, is that
object's error (``TypeError`` to send, ``pickle.UnpicklingError`` to receive),
never the caller's own. An object is first pickled on the loop into a sink
that gives up at :data:`THREAD_BYTES`; a larger one is pickled again on a
worker thread, and a payload that large is unpickled on one.
"""

from __future__ import annotations

import pickle
from typing import Any

import anyio
import anyio.to_thread

from aiospawn._rank import wire

#: A pickle this large or larger is encoded and decoded on a worker thread.
THREAD_BYTES = 256 * 1024


class _TooLarge(Exception):
    pass


class _Sink:
    """A file for ``pickle.Pickler`` that refuses to grow past :data:`THREAD_BYTES`."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def write(self, data: bytes | bytearray | pickle.PickleBuffer) -> int:
        # Protocol 5 hands write() an out-of-band-capable buffer of 64 KiB or
        # more as it is: a pickle.PickleBuffer (a numpy array's), which has no
        # len(). Its pickle holds the buffer's bytes in memory order ("A": a
        # Fortran-ordered buffer stays so), as the unpickler reads them back.
        with memoryview(data) as view:
            size = view.nbytes
            self.size += size
            if self.size >= THREAD_BYTES:
                raise _TooLarge
            self.parts.append(view.tobytes("A"))
        return size


async def encode(obj: Any) -> bytes:
    """Pickle ``obj``: on the loop while it stays small, else again on a worker thread.

    Raises:
        TypeError: ``obj`` cannot be pickled (whatever its pickling raised,
            ``SystemExit`` included, is the cause).
        ValueError: Its pickle is larger than a frame carries (``wire.MAX_FRAME_BYTES``).
    """
    sink = _Sink()
    try:
        pickle.Pickler(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except _TooLarge:
        payload = await anyio.to_thread.run_sync(_dumps, obj)
    except BaseException as exc:  # a __reduce__ may raise SystemExit: still obj's error
        raise _unpicklable(obj, exc) from exc
    else:
        payload = b"".join(sink.parts)
    wire.check_size(len(payload))
    return payload


def _dumps(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:
        raise _unpicklable(obj, exc) from exc


def _unpicklable(obj: Any, exc: BaseException) -> TypeError:
    return TypeError(f"cannot send {type(obj).__qualname__} to a rank: {_describe(exc)}")


async def decode(payload: bytes | bytearray, what: str) -> Any:
    """Unpickle a frame's payload, on a worker thread when it is large.

    Args:
        payload: The pickle.
        what: What it is, for the error: ``"rank 1's message"``.

    Raises:
        pickle.UnpicklingError: It cannot be unpickled here; its cause is what
            the unpickling raised, whatever it was (``SystemExit`` too).
    """
    if len(payload) >= THREAD_BYTES:
        return await anyio.to_thread.run_sync(_loads, payload, what)
    return _loads(payload, what)


def _loads(payload: bytes | bytearray, what: str) -> Any:
    try:
        return pickle.loads(payload)
    except BaseException as exc:  # unpickling runs the rank's code: its error, not ours
        error = pickle.UnpicklingError(f"{what} cannot be unpickled here: {_describe(exc)}")
        raise error from exc


def _describe(exc: BaseException) -> str:
    """``repr(exc)``, or its type's name if even that raises."""
    try:
        return repr(exc)
    except BaseException:
        return f"<{type(exc).__qualname__}: repr() failed>"
