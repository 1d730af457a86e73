"""Pipes between the supervisor and a rank, seen from the supervisor."""

from __future__ import annotations

import os

import anyio

from aiospawn._rank.wire import ChildEnd


def rank_pipe() -> tuple[int, ChildEnd]:
    """Make a pipe for a rank to write into: ``(our read end, the rank's write end)``.

    Both ends are close-on-exec; ``multiprocessing`` passes the rank's end
    explicitly under ``spawn`` and ``forkserver``.
    """
    read_end, write_end = os.pipe()
    return read_end, ChildEnd(write_end)


def close_watched(fd: int) -> None:
    """Close an fd that a task may be waiting on, waking that task first.

    Closing a watched fd without ``notify_closing()`` leaves its waiter hanging.
    """
    anyio.notify_closing(fd)
    os.close(fd)
