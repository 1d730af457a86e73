"""A rank's end: the failure that came first is the root cause; a finished rank reads as finished.

Root cause: a supervisor that polls (torch's elastic agent calls ``join(-1)``
every ``monitor_interval`` through ``aiospawn.sync``) may find several exits
at once; the rank blamed is the one whose failure came first, by when it
failed, not the one with the lowest index.

A rank's end: every rank runs Python's exit steps and ends with ``os._exit``,
so what would crash in the interpreter's finalization or in the C library's
``exit()`` (C++ static destructors: torch's gloo aborted a third of the
``spawn`` runs of a two-rank DDP job) cannot turn a finished rank into a
failed one. The torch job itself is in ``test_rank_exit_torch``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from typing import Any

import anyio
import pytest

import aiospawn
import aiospawn.sync
from tests import exit_ranks
from tests.helpers import tripwire, wait_exited

START_METHODS = ["spawn", "forkserver", "fork"]


def pipe_ends() -> tuple[Any, Any]:
    """Both ends of a pipe for :func:`exit_ranks.fail_after_peer`: ``(reader, writer)``."""
    return multiprocessing.Pipe(duplex=False)


def close_ours(ends: tuple[Any, Any]) -> None:
    """The ranks hold their own copies now: rank 0 sees end-of-file once rank 1 exits."""
    for end in ends:
        end.close()


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_sync_polling_blames_the_rank_that_failed_first(start_method: str) -> None:
    # The elastic agent's loop: start without joining, then join(-1) every
    # monitor_interval. The interval here is "until both ranks have exited",
    # longer than the gap between the failures by construction: one poll
    # finds both exits.
    ends = pipe_ends()
    ctx = aiospawn.sync.start_processes(
        exit_ranks.fail_after_peer, ends, nprocs=2, join=False, start_method=start_method
    )
    close_ours(ends)
    wait_exited(ctx.pids())
    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        ctx.join(-1)  # the first poll finds both
    assert caught.value.error_index == 1
    assert "rank 1 fails first, by itself" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.anyio
async def test_async_join_blames_the_rank_that_failed_first() -> None:
    ends = pipe_ends()
    ctx = await aiospawn.start_processes(exit_ranks.fail_after_peer, ends, nprocs=2, join=False)
    close_ours(ends)
    with tripwire(60, "the ranks' exits"):
        await anyio.to_thread.run_sync(wait_exited, ctx.pids())
        with pytest.raises(aiospawn.ProcessRaisedException) as caught:
            await ctx.join()
    assert caught.value.error_index == 1
    assert "rank 1 fails first, by itself" in str(caught.value)
    assert "failed=rank 1" in repr(ctx)


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", START_METHODS)
async def test_finished_rank_reads_as_finished_whatever_its_finalization_would_do(
    start_method: str,
) -> None:
    ctx = await aiospawn.start_processes(
        exit_ranks.finish_then_crash,
        nprocs=2,
        join=False,
        start_method=start_method,
        stdout="capture",
    )
    with tripwire(60, "two ranks that return"):
        assert await ctx.join()
        lines = [(item.rank, item.line) async for item in ctx.output()]
    assert ctx.results == [0, 1]
    # fn's atexit handler ran, and what it wrote without a newline was flushed.
    assert sorted(lines) == [(0, "atexit of rank 0"), (1, "atexit of rank 1")]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", START_METHODS)
async def test_failed_rank_reads_as_raised_whatever_its_finalization_would_do(
    start_method: str,
) -> None:
    ctx = await aiospawn.start_processes(
        exit_ranks.raise_then_crash, nprocs=1, join=False, start_method=start_method
    )
    with (
        tripwire(60, "a rank that raises"),
        pytest.raises(aiospawn.ProcessRaisedException) as caught,
    ):
        await ctx.join()
    assert isinstance(caught.value.__cause__, ValueError)
    exited = ctx.statistics().ranks[0].last_exit
    assert exited is not None
    assert (exited.exit_code, exited.signal_name) == (1, None)  # not SIGABRT


@pytest.mark.anyio
async def test_fork_rank_runs_none_of_the_supervisors_atexit_handlers() -> None:
    # A fork rank inherits the supervisor's handlers; they are the
    # supervisor's to run at its own end, never the rank's.
    def supervisors() -> None:
        os.write(1, b"the supervisor's atexit handler ran\n")

    atexit.register(supervisors)
    try:
        ctx = await aiospawn.start_processes(
            exit_ranks.finish_then_crash,
            nprocs=1,
            join=False,
            start_method="fork",
            stdout="capture",
        )
        with tripwire(60, "a rank that returns"):
            assert await ctx.join()
            lines = [item.line async for item in ctx.output()]
    finally:
        atexit.unregister(supervisors)
    assert lines == ["atexit of rank 0"]


def test_sync_spawn_of_ranks_whose_finalization_would_crash() -> None:
    assert aiospawn.sync.spawn(exit_ranks.finish_then_crash, nprocs=2) is None
