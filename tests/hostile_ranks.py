"""Rank functions that misuse their process: odd exit codes, closed descriptors, snooping.

Importable, so that ``spawn`` and ``forkserver`` ranks can run them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any


def exit_with(rank: int, code: int) -> None:
    """``sys.exit(code)``."""
    sys.exit(code)


def exit_with_int(rank: int, code: str) -> None:
    """``sys.exit(int(code))``: for ``aiospawn run --fn``, whose arguments are strings."""
    sys.exit(int(code))


def exit_with_code_or_return(rank: int, code: int) -> str:
    """Rank 0 calls ``sys.exit(code)``; the others return."""
    if rank == 0:
        sys.exit(code)
    return "fine"


def put_then_return(rank: int, queue: Any, size: int) -> int:
    """Put ``size`` bytes on a ``multiprocessing.Queue`` (its feeder thread sends them), return."""
    queue.put(b"x" * size)
    return rank


def _fd_table() -> dict[int, tuple[str, int]]:
    """``fd -> (what it is, access mode)`` for every descriptor of this process."""
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            with open(f"/proc/self/fdinfo/{name}") as info:
                flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
        except (OSError, StopIteration):  # the listing's own descriptor
            continue
        table[int(name)] = (target, flags & os.O_ACCMODE)
    return table


def _mapped_heartbeats() -> int:
    with open("/proc/self/maps") as maps:
        return sum("aiospawn-heartbeat" in line for line in maps)


def report_holdings(rank: int, events: Any) -> None:
    """Send ``("holdings", rank, fd table, heartbeat mappings)``, then wait to be stopped."""
    events.send(("holdings", rank, _fd_table(), _mapped_heartbeats()))
    while True:
        time.sleep(60)


def close_every_fd_then_return(rank: int) -> str:
    """Close every descriptor above 2, as daemonising code does, then return a value."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    return "lost"


def close_every_fd_then_exit(rank: int, code: int) -> None:
    """Close every descriptor above 2, then ``sys.exit(code)``."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    sys.exit(code)


def close_every_fd_then_wait(rank: int, report: str) -> None:
    """Close every descriptor above 2, write ``report`` (a FIFO's path), then sleep on."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    with open(report, "w") as fifo:
        fifo.write(f"{os.getpid()}\n")
    while True:
        time.sleep(60)


def reuse_low_fds_then_return(rank: int, path: str) -> str:
    """Close every descriptor above 2, open files until one lands on each freed number, return.

    The channel's old number (if it was low) then holds a file of the rank's;
    the frame must not be written into it.
    """
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    opened = [os.open(path, os.O_WRONLY | os.O_APPEND) for _ in range(200)]
    del opened  # left open: the bootstrap must not write into any of them
    return "lost"


def generator_rank(rank: int) -> Iterator[int]:
    """A generator function: calling it runs nothing."""
    yield rank


async def async_generator_rank(rank: int) -> AsyncIterator[int]:
    """An async generator function: calling it runs nothing."""
    yield rank


def returns_rank(rank: int) -> int:
    return rank
