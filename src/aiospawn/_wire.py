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

import enum
import struct

HEADER = struct.Struct("!BQ")


class Kind(enum.IntEnum):
    """What a frame's payload holds."""

    #: ``pickle(value)``: ``fn`` returned, or called ``sys.exit()`` with 0 or None.
    RETURNED = 1
    #: ``pickle((exception_pickle_or_None, type_name, traceback_text))``.
    RAISED = 2
    #: ``pickle((exit_code, text_or_None))``: ``fn`` called ``sys.exit(n)``.
    EXITED = 3


def header(kind: Kind, size: int) -> bytes:
    """Return the header that precedes a payload of ``size`` bytes."""
    return HEADER.pack(kind, size)


class FrameReader:
    """Reassembles one frame from the chunks read off the pipe."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._kind: Kind | None = None
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
        """Add bytes read from the pipe; the frame never takes more than it needs."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._kind is None and self._buffered >= HEADER.size:
            joined = b"".join(self._chunks)
            kind, self._size = HEADER.unpack_from(joined)
            self._kind = Kind(kind)
            rest = joined[HEADER.size :]
            self._chunks = [rest]
            self._buffered = len(rest)

    def frame(self) -> tuple[Kind, bytes] | None:
        """Return ``(kind, payload)`` once complete, else ``None``."""
        if not self.complete:
            return None
        assert self._kind is not None
        payload = b"".join(self._chunks)
        self._chunks = [payload]
        return self._kind, payload
