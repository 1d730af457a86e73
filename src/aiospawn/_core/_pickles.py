"""Pickling what the supervisor and its ranks exchange: off the loop when large.

Pickles are user code both ways (a ``__reduce__``, a class's module import):
whatever it raises, ``SystemExit`` and ``KeyboardInterrupt`` included, is that
object's error (``TypeError`` to send, ``pickle.UnpicklingError`` to receive),
never the caller's own. An object is first pickled on the loop into a sink
that gives up after :data:`ENCODE_SECONDS` of work or :data:`ENCODE_BYTES`;
such an object is pickled again on a worker thread. A payload of
:data:`THREAD_BYTES` or more is unpickled on one, unless its pickle is mostly
raw bytes (:func:`_mostly_bytes`). Both rules let a payload that is mostly
copying (a megabyte of ``bytes`` takes a fraction of a millisecond, less than
a thread's round trip) stay on the loop, and send the rest off it: pickling
tells the two apart by the time it takes, and can give up; unpickling cannot
be stopped part-way (a megabyte of small objects took 12-78 ms to rebuild on
this project's test machine), so the pickle's layout decides.

Over a link that shares memory (``Link.shares_memory``: local ranks on
Linux), out-of-band buffers of ``buffers.SHARED_BYTES`` (1 MiB) or more are
left out of the pickle and written into a memfd, on a worker thread, which
travels with the frame (``aiospawn._rank.buffers``); the receiver maps it.
The supervisor's memfds are its group's reused segments where one is free
(``_pool``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from aiospawn._rank import buffers, wire
from aiospawn._rank.buffers import Mapped, Packed

from ._pool import Segment, SegmentPool, close_all

T = TypeVar("T")

#: A pickle this large or larger (its mapped buffers included) is decoded on
#: a worker thread.
THREAD_BYTES = 256 * 1024
#: Pickling on the loop gives up once it has taken this long (checked at each
#: write, every 64 KiB of pickle) ...
ENCODE_SECONDS = 0.002
#: ... or once the pickle reaches this size; the object is then pickled on a thread.
ENCODE_BYTES = 2 * 1024 * 1024
#: A pickle up to this size is unpickled on the loop if no more than
#: :data:`LOAD_OBJECT_BYTES` of it describe objects; the rest is raw bytes.
LOAD_BYTES = 2 * 1024 * 1024
LOAD_OBJECT_BYTES = 32 * 1024


class _TooLarge(Exception):
    pass


class _Sink:
    """A ``pickle.Pickler`` file that gives up at :data:`ENCODE_BYTES` or :data:`ENCODE_SECONDS`."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self._deadline = time.perf_counter() + ENCODE_SECONDS

    def write(self, data: bytes | bytearray | pickle.PickleBuffer) -> int:
        # Protocol 5 hands write() an out-of-band-capable buffer of 64 KiB or
        # more as it is: a pickle.PickleBuffer (a numpy array's), which has no
        # len(). Its pickle holds the buffer's bytes in memory order ("A": a
        # Fortran-ordered buffer stays so), as the unpickler reads them back.
        with memoryview(data) as view:
            size = view.nbytes
            self.size += size
            if self.size >= ENCODE_BYTES or time.perf_counter() > self._deadline:
                raise _TooLarge
            # A bytes object cannot change: kept as it is, it is copied once, by the join.
            self.parts.append(data if type(data) is bytes else view.tobytes("A"))
        return size


async def encode(obj: Any, shared: bool = False, pool: SegmentPool | None = None) -> Packed:
    """Pickle ``obj``: on the loop while it is quick, else again on a worker thread.

    Args:
        obj: What to send.
        shared: Large out-of-band buffers go into a memfd (the link shares memory).
        pool: The group's segments (``_pool``), reused for those buffers where
            one is free; without one, or without room, a fresh memfd.

    Returns:
        The frame's body, and the memfd if one was made: the caller closes it
        (``Packed.close()``) once the frame is queued, whatever happens. A
        pooled message (``_pool.PooledPacked``) is claimed for each channel
        it is queued on.

    Raises:
        TypeError: ``obj`` cannot be pickled (whatever its pickling raised,
            ``SystemExit`` included, is the cause).
        ValueError: Its pickle is larger than a frame carries (``wire.MAX_FRAME_BYTES``).
        OSError: No memory for the memfd.
    """
    sink = _Sink()
    large: list[memoryview] | None = [] if shared else None
    try:
        try:
            buffers.pickler(sink, large).dump(obj)
        except TypeError:
            # Perhaps a memoryview, which plain pickle refuses: again, with views.
            sink, large = _Sink(), [] if shared else None
            buffers.pickler(sink, large, views=True).dump(obj)
    except _TooLarge:
        if pool is None:
            # The thread's result comes back even if the task is cancelled
            # meanwhile (anyio waits for the thread): its memfd is never lost.
            packed = await _off_loop(_dumps, obj, shared)
        else:
            body, large = await _off_loop(_pickle_apart, obj, shared)
            packed = await _share(body, large, pool) if large else Packed(body)
    except BaseException as exc:  # a __reduce__ may raise SystemExit: still obj's error
        raise _unpicklable(obj, exc) from exc
    else:
        body = sink.parts[0] if len(sink.parts) == 1 else b"".join(sink.parts)
        # Writing the buffers into the memfd copies them: off the loop.
        packed = await _share(body, large, pool) if large else Packed(body)
    try:
        wire.check_size(len(packed.body))
    except ValueError:
        packed.close()
        raise
    return packed


async def _share(body: bytes, large: list[memoryview], pool: SegmentPool | None) -> Packed:
    """Write ``large`` into a free segment of ``pool``, else into a fresh memfd, off the loop."""
    if pool is None:
        return await _off_loop(buffers.pack, body, large)
    spans, end = buffers.place(large)
    segment = pool.take(end)
    # Given up to make room: closed on the thread, where freeing their pages
    # does not hold up the loop.
    evicted = pool.evicted()
    if segment is None:
        return await _off_loop(_pack_fresh, body, large, evicted)
    packed = pool.packed(segment, buffers.layout(spans, segment.token) + body)
    try:
        await _off_loop(_rewrite, segment, spans, large, evicted)
    except BaseException:
        packed.close()
        raise
    return packed


def _pack_fresh(body: bytes, large: list[memoryview], evicted: list[Any]) -> Packed:
    close_all(evicted)
    return buffers.pack(body, large)


def _rewrite(
    segment: Segment, spans: list[tuple[int, int]], large: list[memoryview], evicted: list[Any]
) -> None:
    close_all(evicted)
    segment.write(spans, large)


def _dumps(obj: Any, shared: bool) -> Packed:
    body, large = _pickle_apart(obj, shared)
    return buffers.pack(body, large) if large else Packed(body)


def _pickle_apart(obj: Any, shared: bool) -> tuple[bytes, list[memoryview] | None]:
    large: list[memoryview] | None = [] if shared else None
    try:
        body = buffers.pickle_body(obj, large)
    except BaseException as exc:
        raise _unpicklable(obj, exc) from exc
    return body, large


def _unpicklable(obj: Any, exc: BaseException) -> TypeError:
    return TypeError(f"cannot send {type(obj).__qualname__} to a rank: {_describe(exc)}")


async def decode(payload: wire.Payload | memoryview, what: str) -> Any:
    """Unpickle a frame's payload, on a worker thread when it is large.

    Args:
        payload: The pickle (with its mapped buffers, for a shared frame).
        what: What it is, for the error: ``"rank 1's message"``.

    Raises:
        pickle.UnpicklingError: It cannot be unpickled here; its cause is what
            the unpickling raised, whatever it was (``SystemExit`` too).
    """
    if len(payload) >= THREAD_BYTES and (isinstance(payload, Mapped) or not _mostly_bytes(payload)):
        return await _off_loop(_loads, payload, what)
    return _loads(payload, what)


#: The pickle opcodes of a large string or bytes object that protocol 5 writes
#: outside its frames, with the width of their length field: BINBYTES,
#: BINUNICODE, BINUNICODE8, BINBYTES8, BYTEARRAY8.
_BLOBS = {0x42: 4, 0x58: 4, 0x8D: 8, 0x8E: 8, 0x96: 8}
_PROTO, _FRAME, _MEMOIZE, _STOP = 0x80, 0x95, 0x94, 0x2E


def _mostly_bytes(payload: bytes | bytearray | memoryview) -> bool:
    """True if unpickling ``payload`` is mostly copying raw bytes: quick enough for the loop.

    Protocol 5 frames the opcodes that build objects, and writes each string
    or bytes object of 64 KiB or more outside the frames. So the frames' sizes
    bound the work of building objects, the rest is copies: True if the
    pickle is at most :data:`LOAD_BYTES`, its frames hold at most
    :data:`LOAD_OBJECT_BYTES`, and it has nothing else outside them. Anything
    unexpected reads as False (a worker thread unpickles it).
    """
    view = memoryview(payload)
    end = len(view)
    if end > LOAD_BYTES or end < 2 or view[0] != _PROTO:
        return False
    position, framed = 2, 0
    while position < end and framed <= LOAD_OBJECT_BYTES:
        op = view[position]
        if op == _FRAME:
            size = int.from_bytes(view[position + 1 : position + 9], "little")
            framed += size
            position += 9 + size
        elif op in _BLOBS:
            width = _BLOBS[op]
            size = int.from_bytes(view[position + 1 : position + 1 + width], "little")
            position += 1 + width + size
        elif op == _MEMOIZE:  # may follow a blob outside a frame
            framed += 1
            position += 1
        else:
            return op == _STOP and position + 1 == end and framed <= LOAD_OBJECT_BYTES
    # The last frame holds the STOP, if it ended exactly at the end.
    return position == end and framed <= LOAD_OBJECT_BYTES


def _loads(payload: wire.Payload | memoryview, what: str) -> Any:
    try:
        return buffers.loads(payload)
    except BaseException as exc:  # unpickling runs the rank's code: its error, not ours
        error = pickle.UnpicklingError(f"{what} cannot be unpickled here: {_describe(exc)}")
        raise error from exc


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread, which keeps no reference to its arguments or result.

    An idle worker thread holds its last job's arguments and result until its
    next job: a received array, its mapping, or the buffers of a sent one
    would live on for as long.
    """
    box: list[Any] = [args, None]

    def run() -> None:
        given, box[0] = box[0], None
        try:
            box[1] = fn(*given)
        finally:
            del given

    await anyio.to_thread.run_sync(run)
    result: T = box[1]
    box[1] = None
    return result


def _describe(exc: BaseException) -> str:
    """``repr(exc)``, or its type's name if even that raises."""
    try:
        return repr(exc)
    except BaseException:
        return f"<{type(exc).__qualname__}: repr() failed>"
