"""Rank functions for the tests: importable, so that spawn and forkserver ranks reach them.

Each is called as ``fn(rank, *args)``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any


def identity(rank: int, value: Any = None) -> Any:
    return value


def rank_times(rank: int, factor: int) -> int:
    return rank * factor


def sleep_forever(rank: int) -> None:
    while True:
        time.sleep(3600)


def raise_in(rank: int, failing: int) -> None:
    if rank == failing:
        raise ValueError(f"legitimate exception from process {rank}")
    sleep_forever(rank)


def exit_with(rank: int, code: Any) -> None:
    sys.exit(code)


def hard_exit(rank: int, code: int) -> None:
    os._exit(code)


def kill_self(rank: int, signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(60)


def ignore_sigterm(rank: int, ready: Any = None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ready is not None:
        ready.put(rank)
    sleep_forever(rank)


def report_ready(rank: int, ready: Any) -> None:
    """Tell the test this rank is running, then sleep until stopped."""
    ready.put((rank, os.getpid()))
    sleep_forever(rank)
