"""Exit detection (``aiospawn._local._rank``): prompt despite grandchildren, no deadlock on
big results, exact exit codes under load."""

from __future__ import annotations

import multiprocessing
import os
import signal

import psutil
import pytest

import aiospawn
from tests import ranks
from tests.helpers import receive, tripwire, wait_until

# Its subject is the glue between the group and the event loop: both loops.
pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]

START_METHODS = ["spawn", "forkserver", "fork"]


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("outcome", ["return", "exit"])
@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_grandchild_holding_the_pipes_does_not_delay_the_rank_exit(
    start_method: str, outcome: str
) -> None:
    """The grandchild keeps the rank's result pipe (and, under spawn and fork, the
    sentinel) open for 30 s; the result or the exit is seen as soon as the rank ends.

    A rank that returns kills its leftover processes before it reports, so only
    the ``os._exit`` rank leaves the grandchild (in a session of its own) running."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    grandchild = None
    with reader, writer:
        try:
            ctx = await aiospawn.start_processes(
                ranks.watch_fork_grandchild,
                (writer, os.getpid(), outcome),
                join=False,
                start_method=start_method,
                grace_period=1,
            )
            grandchild = await receive(reader, "the grandchild's pid")
            # Generous: the grandchild sleeps 30 s, and only waiting for it takes that long.
            with tripwire(10, "noticing the exit of a rank whose grandchild holds its pipes"):
                if outcome == "return":
                    assert await ctx.join() is True
                    assert ctx.results == ["returned"]
                else:
                    with pytest.raises(aiospawn.ProcessExitedException) as info:
                        await ctx.join()
                    assert (info.value.error_index, info.value.exit_code) == (0, 5)
            if outcome == "return":
                assert wait_until(lambda: not is_alive(grandchild)), "a leftover survived"
            else:
                assert is_alive(grandchild), "the grandchild ended early: the test proved nothing"
        finally:
            if grandchild is not None:
                os.kill(grandchild, signal.SIGKILL)
                assert wait_until(lambda: not is_alive(grandchild))


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_a_50_mb_result_comes_back_without_deadlock(start_method: str) -> None:
    size = 50 * 1024 * 1024
    with tripwire(60, "reading a 50 MB result"):
        results = await aiospawn.start_processes(
            ranks.watch_big_result, (size,), start_method=start_method
        )
    assert len(results[0]) == size
    assert results[0] == bytes(range(256)) * (size // 256)


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_exit_codes_stay_exact_under_load(start_method: str) -> None:
    """16 ranks exit at once, each with its own code: every code is reported exactly.

    A generous ``grace_period`` lets every rank exit by itself after the first
    failure, so nobody is stopped by us and each exit code is the rank's own.
    """
    nprocs = 16
    ctx = await aiospawn.start_processes(
        ranks.watch_exit_by_rank,
        nprocs=nprocs,
        join=False,
        start_method=start_method,
        grace_period=30,
    )
    with (
        tripwire(60, "joining 16 ranks that exit at once"),
        pytest.raises(aiospawn.ProcessExitedException) as info,
    ):
        await ctx.join()
    error = info.value
    assert error.exit_code == error.error_index % 7 + 1
    assert error.error_pid == ctx.pids()[error.error_index]
    assert error.msg == f"process {error.error_index} terminated with exit code {error.exit_code}"
    assert [p.exitcode for p in ctx.processes] == [rank % 7 + 1 for rank in range(nprocs)]
