"""The one message a rank sends back to its supervisor: how ``fn`` ended.

A rank writes a single frame on its private pipe just before it exits::

    +----------+------------------+---------------------+
    | kind: 1B | size: 8B, big-end | payload: size bytes |
    +----------+------------------+---------------------+

The frame carries its own length, so the supervisor knows when it is complete
without waiting for end-of-file: a grandchild that inherited the pipe's write
end would otherwise hold the supervisor up until it exits too.

This module is imported by the rank bootstrap, so it uses the standard library
only (see ``_child``).
"""

from __future__ import annotations

import struct
from typing import Any, Final

HEADER = struct.Struct("!BQ")


class Kind:
    """What a frame's payload holds (plain ints: an enum would cost every rank its set-up)."""

    #: ``pickle(value)``: ``fn`` returned, or called ``sys.exit()`` with 0 or None.
    RETURNED: Final = 1
    #: ``pickle((exception_pickle_or_None, type_name, traceback_text))``.
    RAISED: Final = 2
    #: ``pickle((exit_code, text_or_None))``: ``fn`` called ``sys.exit(n)``.
    EXITED: Final = 3


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


class FrameReader:
    """Reassembles one frame from the chunks read off the pipe."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._kind: int | None = None
        self._size = 0

    @property
    def complete(self) -> bool:
        """True once the whole frame has been fed."""
        return self._kind is not None and self._buffered >= self._size

    @property
    def wanted(self) -> int:
        """How many more bytes the frame needs (an upper bound before the header)."""
        if self._kind is None:
            return HEADER.size - self._buffered
        return self._size - self._buffered

    def feed(self, data: bytes) -> None:
        """Add bytes read from the pipe (at most :attr:`wanted` at a time)."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._kind is None and self._buffered >= HEADER.size:
            joined = b"".join(self._chunks)
            self._kind, self._size = HEADER.unpack_from(joined)
            rest = joined[HEADER.size :]
            self._chunks = [rest]
            self._buffered = len(rest)

    def frame(self) -> tuple[int, bytes] | None:
        """Return ``(kind, payload)`` once complete, else ``None``."""
        if not self.complete:
            return None
        assert self._kind is not None
        payload = b"".join(self._chunks)
        self._chunks = [payload]
        return self._kind, payload
