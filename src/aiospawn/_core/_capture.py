"""Captured output: the lines of a group's ``capture`` streams, waiting for ``ctx.output()``.

Backends put lines in; ``ctx.output()`` takes them out. Readers of the ranks'
pipes hold the ranks back while the buffer is full, so a rank that writes faster
than its consumer reads waits in ``write`` instead of growing memory.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import NamedTuple

from ._concurrency import Broadcast

#: Captured lines held for ``ctx.output()`` before the ranks are held back.
CAPTURE_BUFFER_LINES = 10_000


class OutputLine(NamedTuple):
    """One line a rank wrote, as ``ctx.output()`` yields it."""

    rank: int
    stream: str
    line: str


class CaptureBuffer:
    """Captured lines of a whole group, waiting for ``ctx.output()``."""

    def __init__(self) -> None:
        self._lines: collections.deque[OutputLine] = collections.deque()
        self._changed = Broadcast()
        self._closed = False

    @property
    def full(self) -> bool:
        """True while readers should hold the ranks back."""
        return len(self._lines) >= CAPTURE_BUFFER_LINES

    def put(self, line: OutputLine) -> None:
        """Add a line; the bound is applied by readers waiting in :meth:`wait_for_room`."""
        self._lines.append(line)
        self._changed.notify()

    def close(self) -> None:
        """No more lines will come: iteration ends once the buffer is empty."""
        self._closed = True
        self._changed.notify()

    async def wait_for_room(self) -> None:
        """Wait while the buffer is full."""
        while self.full:
            await self._changed.wait()

    async def lines(self) -> AsyncIterator[OutputLine]:
        """Yield lines as they come, until closed and drained."""
        while True:
            while self._lines:
                line = self._lines.popleft()
                self._changed.notify()
                yield line
            if self._closed:
                return
            await self._changed.wait()
