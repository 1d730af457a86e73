"""Ranks for test_rank_exit: which failure came first, and what a rank's end runs."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import resource
import sys
from typing import Any


def fail_after_peer(rank: int, reader: Any, writer: Any) -> None:
    """Rank 1 raises; rank 0 raises once rank 1 has exited (its end of ``writer`` closed).

    A handshake, not a delay: rank 0's failure follows rank 1's whatever the
    load. ``reader`` and ``writer`` are the two ends of one pipe; the
    supervisor closes its own copies once the ranks have started.
    """
    if rank == 1:
        reader.close()
        raise ValueError("rank 1 fails first, by itself")
    writer.close()
    with contextlib.suppress(EOFError):
        reader.recv()
    raise RuntimeError("rank 0 fails because rank 1 did")


def abort_at_exit() -> None:
    """Make the C library's exit() abort the process, as a C++ static destructor may.

    abort(3) itself is registered as a C++ static destructor is, with
    ``__cxa_atexit``: it runs in exit(3), after the interpreter has finalized.
    """
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file if it does abort
    libc = ctypes.CDLL(None)
    if libc.__cxa_atexit(libc.abort, None, None) != 0:
        raise OSError("__cxa_atexit refused the handler")


class AbortWhenFinalized:
    """Aborts the process when finalized: held by a module global, at interpreter shutdown."""

    def __del__(self) -> None:
        os.abort()


_held: list[AbortWhenFinalized] = []


def finish_then_crash(rank: int) -> int:
    """Return ``rank`` from a rank whose finalization would crash; its atexit handler writes.

    The handler writes without a newline: only a flush at the rank's end
    delivers it.
    """
    abort_at_exit()
    _held.append(AbortWhenFinalized())
    # sys.__stdout__, the stream on fd 1: in a fork rank of pytest, sys.stdout
    # is pytest's capture of the supervisor's output.
    atexit.register(lambda: sys.__stdout__.write(f"atexit of rank {rank}"))
    return rank


def raise_then_crash(rank: int) -> None:
    """Raise from a rank whose finalization would crash: it reads as raised, not aborted."""
    abort_at_exit()
    raise ValueError(f"rank {rank} raised")
