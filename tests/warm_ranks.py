"""Rank functions for tests/test_warm.py (importable: warm ranks receive ``fn`` pickled)."""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import aiospawn

COUNTED = "tests.warm_modules.counted"


def report(rank: int) -> dict[str, Any]:
    """Where this rank runs, and what it found imported."""
    counted = sys.modules.get(COUNTED)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "preloaded": counted is not None,
        "imported_in": getattr(counted, "IMPORTED_IN", None),
        "probe_at_import": getattr(counted, "PROBE_AT_IMPORT", None),
        "probe_now": os.environ.get("WARM_PROBE"),
        "restart": aiospawn.restart_count(),
    }


def fail_first_run(rank: int) -> dict[str, Any]:
    """Rank 1 raises on its first run; every run reports as :func:`report` does."""
    if rank == 1 and aiospawn.restart_count() == 0:
        raise ValueError("rank 1 fails its first run")
    return report(rank)


def ready_then_wait(rank: int, writer: Connection) -> None:
    """Say ``("ready", rank, pid)``, then wait for a signal."""
    writer.send(("ready", rank, os.getpid()))
    signal.pause()


def say_and_beat(rank: int) -> int:
    """Print a line on each stream and send a heartbeat."""
    print(f"out from rank {rank}", flush=True)
    print(f"err from rank {rank}", file=sys.stderr, flush=True)
    aiospawn.heartbeat()
    return rank
