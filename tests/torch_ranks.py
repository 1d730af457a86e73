"""Rank functions for the aiospawn.sync tests, mirroring torch's test_multiprocessing_spawn helpers.

The first block follows torch's ``_test_*_func`` helpers one for one (the
4-second sleep of ``_test_terminate_exit_func`` is 2 s here, to keep the suite
fast); the second holds what the tests of torch's defects need. Each is called
as ``fn(rank, *args)``.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import pickle
import random
import resource
import signal
import sys
import time
from typing import Any

# torch's helpers --------------------------------------------------------------


def success(rank: int) -> None:
    """``_test_success_func``."""


def success_single_arg(rank: int, queue: Any) -> None:
    """``_test_success_single_arg_func``: report the rank."""
    if queue:
        queue.put(rank)


def exception_single(rank: int, failing: int) -> None:
    """``_test_exception_single_func``."""
    if rank == failing:
        raise ValueError(f"legitimate exception from process {rank}")
    time.sleep(1.0)


def exception_all(rank: int) -> None:
    """``_test_exception_all_func``."""
    time.sleep(random.random() / 10)
    raise ValueError(f"legitimate exception from process {rank}")


def terminate_signal(rank: int) -> None:
    """``_test_terminate_signal_func``: rank 0 aborts itself."""
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the tree
        faulthandler.disable()  # a fork inherits pytest's; keep the abort quiet
        os.kill(os.getpid(), signal.SIGABRT)
    time.sleep(1.0)


def terminate_exit(rank: int, code: int) -> None:
    """``_test_terminate_exit_func``: rank 0 exits with ``code``, the others after 2 s."""
    if rank == 0:
        sys.exit(code)
    time.sleep(2.0)


def success_first_then_exception(rank: int, arg: Any) -> None:
    """``_test_success_first_then_exception_func``."""
    if rank == 0:
        return
    time.sleep(0.1)
    raise ValueError("legitimate exception")


def infinite_task(rank: int) -> None:
    """``_test_infinite_task``."""
    while True:
        time.sleep(1)


# aiospawn.sync's own -----------------------------------------------------------


def wait_for_go(rank: int, ready: Any, go: Any) -> int:
    """Report ``(rank, pid)``, wait until the test sets ``go``, return the rank."""
    ready.put((rank, os.getpid()))
    go.wait()
    return rank


def first_returns_then_wait(rank: int, go: Any) -> None:
    """Rank 0 returns at once; the others wait until the test sets ``go``."""
    if rank != 0:
        go.wait()


def sleep_forever_with(rank: int, arg: Any) -> None:
    """Take one argument and run until stopped."""
    while True:
        time.sleep(3600)


def first_returns_then_sleep(rank: int) -> None:
    """Rank 0 returns at once; the others run until stopped."""
    while rank != 0:
        time.sleep(3600)


def raise_keyboard_interrupt(rank: int) -> None:
    raise KeyboardInterrupt


def fail_on_go_sibling_ignores_sigterm(rank: int, ready: Any, go: Any) -> None:
    """Rank 0 raises once ``go`` is set; rank 1 ignores SIGTERM and reports its pid."""
    if rank == 0:
        go.wait()
        raise ValueError("rank 0 failed on purpose")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.put((rank, os.getpid()))
    while True:
        time.sleep(3600)


class PicklesOnce:
    """An argument that pickles the first time and fails every later time.

    Each rank's start pickles ``args`` again, so the rank whose start comes
    first starts and the others fail to: a start that fails part-way through.
    """

    def __init__(self) -> None:
        self._pickles = itertools.count()

    def __reduce__(self) -> tuple[Any, ...]:
        if next(self._pickles):
            raise pickle.PicklingError("PicklesOnce pickles only once")
        return str, ("pickled once",)
