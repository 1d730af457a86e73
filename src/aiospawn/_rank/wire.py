"""What a rank and its supervisor agree on: the frames both ways, and a few constants.

How ``fn`` ended travels as one frame, which a rank writes on its private pipe
just before it exits (after an ENDED frame that says when ``fn`` ended)::

    +----------+------------------+---------------------+
    | kind: 1B | size: 8B, big-end | payload: size bytes |
    +----------+------------------+---------------------+

The frame carries its own length, so the supervisor knows when it is complete
without waiting for end-of-file: a grandchild that inherited the pipe's write
end would otherwise hold the supervisor up until it exits too.

A rank's channel carries frames of the same shape, both ways: their kinds
(:class:`Link`) and the sizes each end takes (:data:`FROM_RANK`,
:data:`TO_RANK`) are defined here, and read and written elsewhere (``reader``
reassembles and checks one frame, ``stream`` moves frames over the channel's
socket). How a pipe end is handed to a rank (:class:`ChildEnd`) is here too.

The encoders are here too, beside the format they write, for every backend:
``outcome`` encodes how ``fn`` ended with them, then a local rank writes the
frame to its pipe, and a Ray rank hands it back from its actor call. The
supervisor decodes frames in ``aiospawn._core._outcome``.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import struct

from .buffers import TOKEN, Mapped
from .views import dispatch_table

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType
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

#: This package's directory: a frame whose code lives here is the rank side's own.
_HERE = os.path.dirname(__file__)

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
    #: One byte, MESSAGE or CALL: the rank has taken (received, or started or
    #: dropped) the oldest frame of that kind that came with a memfd; the
    #: supervisor's back-pressure counts those buffers until then.
    TAKEN: Final = 8


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
    Link.TAKEN: (1, 1),
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


class FrameError(ValueError):
    """A frame header that breaks the channel's format: an unknown kind, or a size out of range.

    Raised by a frame's reader (``reader.FrameReader``); the stream cannot be read past it.
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
    """The frame of a returned value, or of the TypeError if it cannot be pickled.

    A value may hold a ``memoryview``, as a message may (see ``views``); its
    buffers stay in the frame. Pickled once, with the view reducer in the
    pickler's table from the start: a result is pickled once per rank, so
    the table's cost does not count, and a value that cannot be pickled is
    not pickled twice.
    """
    try:
        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = dispatch_table()
        pickler.dump(value)
        payload = out.getvalue()
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


def from_fn(exc: BaseException, entry: CodeType | None = None) -> BaseException:
    """``exc`` with its traceback starting in the user's code.

    Called where ``exc`` was caught: the catching frame (``outcome.run_fn``,
    a channel's ``serve()``) is ours, not the user's, and so are the frames of
    ``aiospawn run``'s wrappers around a script, a module or a function
    (``programs``) between it and the user's code: every leading frame of this
    package goes. ``entry`` is the code the user's part starts with where
    other frames come first (an ``async def fn``'s, below the event loop's):
    the traceback starts at its frame, if it is there. Where every frame is
    ours (``fn`` could not even be called), the innermost one stays, the line
    that made the call.
    """
    tb = exc.__traceback__
    if entry is not None:
        start = tb
        while start is not None and start.tb_frame.f_code is not entry:
            start = start.tb_next
        if start is not None:
            return exc.with_traceback(start)
    while tb is not None and tb.tb_next is not None and _is_ours(tb.tb_frame.f_code):
        tb = tb.tb_next
    return exc.with_traceback(tb)


def _is_ours(code: CodeType) -> bool:
    return os.path.dirname(code.co_filename) == _HERE
