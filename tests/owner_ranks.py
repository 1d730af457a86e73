"""Rank functions for tests/test_owner.py (importable, for ``spawn``)."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

import aiospawn
from tests.ranks import sleep_forever


def echo_size_when_told(rank: int, go: Connection) -> None:
    """Read nothing until told; then answer one message with its size."""
    aiospawn.ready()
    go.recv()
    channel = aiospawn.channel()
    channel.send(len(channel.receive()))


def leave_a_holder_then_exit(rank: int, report: Connection, go: Connection) -> None:
    """Fork a process into a session of its own, which keeps our channel's socket; exit 0 when told.

    The holder's pid goes to ``report``: the test kills it. Rank 1 runs until
    the block ends, so that the group runs on after rank 0's exit.
    """
    channel = aiospawn.channel()
    if rank == 1:
        for _ in channel:  # until the supervisor closes the channel
            pass
        return
    # The rank goes on only once the holder has left its process group:
    # otherwise the rank's exit, and the group kill with it, could come first.
    left, has_left = os.pipe()
    holder = os.fork()
    if holder == 0:  # pragma: no cover - the holder
        os.setsid()
        os.write(has_left, b"!")
        sleep_forever(rank)
    os.close(has_left)
    os.read(left, 1)
    os.close(left)
    report.send(holder)
    channel.send("before")
    go.recv()
    os._exit(0)


def write_then_report(rank: int, size: int, report: Connection) -> str:
    """Write ``size`` bytes of lines to stdout, then say so."""
    line = "x" * 99 + "\n"
    for _ in range(size // len(line)):
        sys.stdout.write(line)
    sys.stdout.flush()
    report.send("written")
    return "done"


def return_or_wait(rank: int, returning: int) -> str:
    """Rank ``returning`` returns at once; the others run until stopped."""
    if rank == returning:
        return f"rank {rank}"
    sleep_forever(rank)
    raise AssertionError("unreachable: a signal ends the wait")
