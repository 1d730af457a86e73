"""Ranks for test_results: values and exceptions whose pickling or unpickling misbehaves.

A value's ``__reduce__`` names a function that runs when the value is
unpickled, which happens in the supervisor: these functions misbehave there.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

#: Set in the supervisor while a slow value is being unpickled, released by the test.
unpickling = threading.Event()
release = threading.Event()


def _exit_in_supervisor(code: int) -> None:
    sys.exit(code)


def _interrupt_in_supervisor() -> None:
    raise KeyboardInterrupt


def _wait_in_supervisor() -> str:
    unpickling.set()
    # Bounded, so that a loop blocked by this unpickle shows as a wrong value.
    return "decoded" if release.wait(10) else "the test could not release it"


class ExitsWhenUnpickled:
    """Unpickling it calls ``sys.exit(3)``, as a module that parses argv at import does."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _exit_in_supervisor, (3,)


class InterruptsWhenUnpickled:
    """Unpickling it raises ``KeyboardInterrupt``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _interrupt_in_supervisor, ()


class WaitsWhenUnpickled:
    """Unpickling it waits until the test sets :data:`release` (a slow unpickle)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _wait_in_supervisor, ()


class ExitsWhenPickled(Exception):
    """An exception whose ``__reduce__`` raises ``SystemExit`` in the rank."""

    def __reduce__(self) -> tuple[Any, ...]:
        raise SystemExit(4)


class ValueExitsWhenPickled:
    """A value whose ``__reduce__`` raises ``SystemExit`` in the rank."""

    def __reduce__(self) -> tuple[Any, ...]:
        raise SystemExit(5)


def return_exiting_value(rank: int) -> ExitsWhenUnpickled | int:
    """Rank 0 returns a value that exits the unpickler; the others return their rank."""
    return ExitsWhenUnpickled() if rank == 0 else rank


def return_interrupting_value(rank: int) -> InterruptsWhenUnpickled:
    return InterruptsWhenUnpickled()


def return_waiting_value(rank: int) -> WaitsWhenUnpickled:
    return WaitsWhenUnpickled()


def return_unpicklable_by_exit(rank: int) -> ValueExitsWhenPickled:
    return ValueExitsWhenPickled()


def raise_unpicklable_by_exit(rank: int) -> None:
    raise ExitsWhenPickled("the original error")


def return_bytes(rank: int, size: int) -> bytes:
    """``size`` bytes, distinct for each rank."""
    return bytes([rank % 256]) * size
