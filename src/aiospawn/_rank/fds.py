"""A rank's own descriptors: kept out of the way of ``fn``'s, and recognised again.

The descriptors a rank holds for aiospawn (the pipe it reports on, its
channel's socket, the stack pipe, the pidfd its guard watches) live beside
``fn``'s own, and ``fn`` may close or reuse any number (``os.closerange``,
``dup2``). So each is moved to :data:`HIGH_FD` or above, away from the low
numbers that code reuses, and remembered by the identity of its file, so that
a number closed and reused since is never taken for ours.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import os

#: A rank's own descriptors are moved to this number or above.
HIGH_FD = 100


def move_high(fd: int) -> int:
    """Move ``fd`` to :data:`HIGH_FD` or above (close-on-exec); keep it if that fails."""
    import fcntl

    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD)
    except OSError:  # RLIMIT_NOFILE at or below HIGH_FD
        return fd
    os.close(fd)
    return high


def identity(fd: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file ``fd`` holds now, or None if it is closed."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino
