"""Helpers shared by the tests: the ranks' report pipe, and checks on pids."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import anyio
import pytest

#: ``(reader, writer)``: the test reads the first end, the ranks write to the second.
Events = tuple[Connection, Connection]


@contextmanager
def tripwire(seconds: float, what: str) -> Iterator[None]:
    """Fail (rather than hang) if the block takes ``seconds``: something deadlocked."""
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        pytest.fail(f"deadlock: {what} did not finish within {seconds} s")


async def receive(reader: Connection, what: str, seconds: float = 30.0) -> Any:
    """Read one message the ranks sent; fail, rather than hang, if none comes in time."""
    if not await anyio.to_thread.run_sync(reader.poll, seconds):
        pytest.fail(f"no {what} from the ranks within {seconds} s")
    return reader.recv()


async def receive_ready(reader: Connection, nprocs: int) -> dict[int, int]:
    """Wait until ``nprocs`` ranks sent ``("ready", rank, pid)``; return pid by rank."""
    pids = {}
    for _ in range(nprocs):
        kind, rank, pid = await receive(reader, "ready message")
        assert kind == "ready"
        pids[rank] = pid
    return pids


def drain(reader: Connection) -> list[Any]:
    """Everything the ranks sent that has not been read yet."""
    messages = []
    while reader.poll(0):
        messages.append(reader.recv())
    return messages


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited and been reaped (a zombie still exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
