"""Descriptors the supervisor holds for its ranks: pipes, and the table a ``fork`` rank clears.

A ``fork`` rank starts with a copy of the supervisor's descriptor table. Every
descriptor the local backend opens for its ranks is recorded here, with the
identity of its file, until it is closed through :func:`close` (or
:func:`close_watched`); a ``fork`` rank gets the table as it was when it was
forked and closes those it does not own (see the rank bootstrap).
"""

from __future__ import annotations

import os
import select

import anyio

from aiospawn._rank.wire import ChildEnd

_held: dict[int, tuple[int, int]] = {}


def track(fd: int) -> int:
    """Record ``fd``, just opened for a rank, as the supervisor's; return it."""
    info = os.fstat(fd)
    _held[fd] = (info.st_dev, info.st_ino)
    return fd


def held() -> dict[int, tuple[int, int]]:
    """The live table: ``fd -> (st_dev, st_ino)`` of every descriptor recorded and open.

    Handed to ``fork`` ranks as it is: the fork copies it at the moment it happens.
    """
    return _held


def readable(fd: int) -> bool:
    """True if ``fd`` can be read now, or was closed meanwhile (``POLLNVAL``); never waits.

    A pidfd is readable once its process has exited, a sentinel once the
    process that reaps it has.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def close(fd: int) -> None:
    """Close a descriptor recorded with :func:`track`."""
    _held.pop(fd, None)
    os.close(fd)


def forget(fd: int) -> None:
    """Drop ``fd`` from the table, before something else (a socket object) closes it."""
    _held.pop(fd, None)


def rank_pipe() -> tuple[int, ChildEnd]:
    """Make a pipe for a rank to write into: ``(our read end, the rank's write end)``.

    Both ends are close-on-exec; ``multiprocessing`` passes the rank's end
    explicitly under ``spawn`` and ``forkserver``.
    """
    read_end, write_end = os.pipe()
    return track(read_end), ChildEnd(track(write_end))


def close_watched(fd: int) -> None:
    """Close an fd that a task may be waiting on, waking that task first.

    Closing a watched fd without ``notify_closing()`` leaves its waiter hanging.
    """
    anyio.notify_closing(fd)
    close(fd)


async def wait_any_readable(fds: list[int]) -> None:
    """Wait until one of ``fds`` is readable."""
    async with anyio.create_task_group() as tg:

        async def wait(fd: int) -> None:
            await anyio.wait_readable(fd)
            tg.cancel_scope.cancel()

        for fd in fds:
            tg.start_soon(wait, fd)
