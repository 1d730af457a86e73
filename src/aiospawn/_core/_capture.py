"""Captured output: the lines of a group's ``capture`` streams, waiting for ``ctx.output()``.

Backends put lines in; ``ctx.output()`` takes them out. The buffer holds
:data:`CAPTURE_BUFFER_LINES` lines, and what happens beyond that depends on
whether anyone reads:

* while a ``ctx.output()`` iteration is attached, the readers of the ranks'
  pipes hold the ranks back: a rank that writes faster than its consumer
  reads waits in ``write`` instead of growing memory;
* while nobody iterates, the oldest lines are dropped (and the drop is
  logged once): a rank must never block for ever because nobody reads, and
  a consumer that attaches late sees the most recent lines.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncGenerator
from typing import NamedTuple

from ._concurrency import Broadcast
from ._log import logger

#: Captured lines held for ``ctx.output()``: beyond this, the ranks are held
#: back while a consumer is attached, and the oldest lines dropped while none is.
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
        self._consumers = 0
        self.dropped = 0

    @property
    def full(self) -> bool:
        """True while readers should hold the ranks back: full, and someone reads."""
        return self._consumers > 0 and len(self._lines) >= CAPTURE_BUFFER_LINES

    def put(self, line: OutputLine) -> None:
        """Add a line; with nobody reading, drop the oldest one beyond the bound.

        With a consumer attached the bound is applied by readers waiting in
        :meth:`wait_for_room`, so nothing is dropped then (lines read after a
        rank exited may overshoot it by one pipe's worth).
        """
        if self._consumers == 0 and len(self._lines) >= CAPTURE_BUFFER_LINES:
            self._lines.popleft()
            if not self.dropped:
                logger.warning(
                    "Nobody iterates ctx.output(): dropping the oldest captured lines"
                    " beyond %d so that the ranks can go on writing",
                    CAPTURE_BUFFER_LINES,
                )
            self.dropped += 1
        self._lines.append(line)
        self._changed.notify()

    def close(self) -> None:
        """No more lines will come: iteration ends once the buffer is empty."""
        self._closed = True
        self._changed.notify()

    async def wait_for_room(self) -> None:
        """Wait while the buffer is full and a consumer is attached."""
        while self.full:
            await self._changed.wait()

    async def lines(self) -> AsyncGenerator[OutputLine, None]:
        """Yield lines as they come, until closed and drained."""
        self._consumers += 1
        try:
            while True:
                while self._lines:
                    line = self._lines.popleft()
                    self._changed.notify()
                    yield line
                if self._closed:
                    return
                await self._changed.wait()
        finally:
            # A consumer that stopped iterating must not keep the ranks held back.
            self._consumers -= 1
            self._changed.notify()
