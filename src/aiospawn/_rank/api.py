"""What a rank's own code calls: :func:`heartbeat` and :func:`restart_count`.

The bootstrap (``aiospawn._rank.bootstrap``) fills in this module's state
before ``fn`` runs; outside a rank every function is a harmless no-op.
Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import time

_restart = 0
_beat: memoryview | None = None


def restart_count() -> int:
    """How many times this rank has been restarted: 0 in its first run.

    Called in a rank of an aiospawn group. A rank resuming from a checkpoint
    can use it to tell its first run from a restart; the same number is in
    the ``AIOSPAWN_RESTART_COUNT`` environment variable. Outside a rank: 0.
    """
    return _restart


def heartbeat() -> None:
    """Tell the supervisor this rank is making progress.

    Cheap enough for a tight loop (one clock read and one store into memory
    shared with the supervisor, about 0.1 microseconds) and safe from any
    thread. Outside a rank, or when the group has neither
    ``heartbeat_timeout`` nor ``startup_timeout``, it does nothing.
    """
    beat = _beat
    if beat is not None:
        beat[0] = time.monotonic_ns()
