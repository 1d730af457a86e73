"""The live status line: one line kept at the bottom of the terminal while the ranks run.

The ranks' output is written by the library (prefixed lines) or by the ranks
themselves (``inherit``), so the line cannot be redrawn around each of their
lines. Instead the terminal's scrolling region (DECSTBM, ``ESC [ top ; bottom r``)
is set to every row but the last: whatever anyone writes scrolls above it,
and the status line is drawn in the last row with the cursor saved and
restored around it (``ESC 7`` / ``ESC 8``), each update one ``write()``.
At the end the region is reset and the line cleared, so the summary table
takes its place. It is redrawn on each event of the group and when the
terminal is resized (SIGWINCH); it is never used when stderr is not a terminal.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

import anyio

from aiospawn._core._events import Event, Exited, Started

if TYPE_CHECKING:
    from aiospawn._core._context import AsyncProcessContext

__all__ = ["StatusLine", "wanted"]

#: Terminals that cannot keep a status line.
DUMB_TERMINALS = ("", "dumb", "unknown")


def wanted(asked: bool | None, nprocs: int, default_above: int, fd: int = 2) -> bool:
    """Whether to show the status line: asked for, or by default, and ``fd`` a capable terminal."""
    if asked is False or not os.isatty(fd) or os.environ.get("TERM", "") in DUMB_TERMINALS:
        return False
    return asked is True or nprocs > default_above


class StatusLine:
    """The status line of one run, on the terminal at ``fd``."""

    def __init__(self, nprocs: int, fd: int = 2) -> None:
        self._fd = fd
        self._nprocs = nprocs
        self._rows = 0
        self._last_failure: str | None = None
        self._restarts = 0
        self._text = f"aiospawn: starting {nprocs} rank{'s' if nprocs != 1 else ''}"
        self._open = False

    def open(self) -> None:
        """Reserve the last row: the rest of the screen scrolls above it."""
        self._open = True
        self._reserve()
        self._draw()

    def close(self) -> None:
        """Give the last row back, cleared, with the cursor where the output left it."""
        if not self._open:
            return
        self._open = False
        # DECSTBM homes the cursor, so the region is reset inside the save/restore.
        self._write(f"\x1b7\x1b[r\x1b[{self._rows};1H\x1b[2K\x1b8")

    def update(self, group: AsyncProcessContext[object], event: Event | None = None) -> None:
        """Redraw from the group's statistics, after ``event`` if there was one."""
        if isinstance(event, Exited) and not event.stopped_by_us and event.outcome != "returned":
            self._last_failure = _failure(event)
        if isinstance(event, Started):
            # The group counts a restart once its ranks have started: the last
            # Started event comes before that.
            self._restarts = max(self._restarts, event.restart)
        statistics = group.statistics()
        restarts = max(statistics.restarts, self._restarts)
        parts = [f"aiospawn: {statistics.alive}/{self._nprocs} running"]
        parts.append(f"{restarts} restart{'s' if restarts != 1 else ''}")
        if self._last_failure is not None:
            parts.append(f"last failure: {self._last_failure}")
        self._text = ", ".join(parts)
        if self._open:
            self._draw()

    def resized(self) -> None:
        """The terminal changed size: reserve its new last row."""
        if self._open:
            self._write(f"\x1b7\x1b[{self._rows};1H\x1b[2K\x1b8")
            self._reserve()
            self._draw()

    async def follow(self, group: AsyncProcessContext[object]) -> None:
        """Keep the line current until cancelled."""
        with anyio.open_signal_receiver(signal.SIGWINCH) as resizes:
            async with anyio.create_task_group() as tasks:

                async def on_resize() -> None:
                    async for _ in resizes:
                        self.resized()

                tasks.start_soon(on_resize)
                self.update(group)
                async for event in group.events():
                    self.update(group, event)
                tasks.cancel_scope.cancel()

    def _reserve(self) -> None:
        self._rows = max(2, os.get_terminal_size(self._fd).lines)
        # A newline first makes room if the cursor is on the last row; the
        # cursor then goes back up into the region (DECSTBM homes it).
        self._write(f"\n\x1b7\x1b[1;{self._rows - 1}r\x1b8\x1b[1A")

    def _draw(self) -> None:
        columns = os.get_terminal_size(self._fd).columns
        text = self._text[: max(1, columns - 1)]
        self._write(f"\x1b7\x1b[{self._rows};1H\x1b[2K{text}\x1b8")

    def _write(self, text: str) -> None:
        data = text.encode()
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # the terminal is gone: nothing left to show
            self._open = False


def _failure(event: Exited) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.wall_time))
    how = event.signal_name or event.outcome
    return f"rank {event.rank} {how} at {when}"
