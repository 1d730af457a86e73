"""torch.multiprocessing.spawn usage, end to end, against aiospawn.sync.

Each test follows a case of torch's ``test/test_multiprocessing_spawn.py``
(same calls, same regexes, same log assertions), with ``aiospawn.sync`` in
place of ``torch.multiprocessing``. They run for ``spawn``, ``fork`` and the
platform default (``None``), as torch's SpawnTest, ForkTest and
ParallelForkServerShouldWorkTest do.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal

import pytest

import aiospawn.sync as mp
from tests import torch_ranks
from tests.helpers import recorders

START_METHODS = ["spawn", "fork", None]

start_methods = pytest.mark.parametrize("start_method", START_METHODS)


def join_until_done(ctx: mp.ProcessContext, grace_period: float | None = None) -> None:
    """torch's loop: ``while not ctx.join(grace_period=...): pass``."""
    while not ctx.join(grace_period=grace_period):
        pass


@start_methods
def test_success(start_method: str | None) -> None:
    assert mp.start_processes(torch_ranks.success, nprocs=2, start_method=start_method) is None


@start_methods
def test_success_non_blocking(start_method: str | None) -> None:
    ctx = mp.start_processes(torch_ranks.success, nprocs=2, join=False, start_method=start_method)
    while not ctx.join():
        pass
    # After all processes exit, join() keeps returning True.
    assert ctx.join(timeout=None)
    assert ctx.join(timeout=None)


@start_methods
def test_first_argument_index(start_method: str | None) -> None:
    queue = multiprocessing.get_context(start_method).SimpleQueue()
    mp.start_processes(
        torch_ranks.success_single_arg, args=(queue,), nprocs=2, start_method=start_method
    )
    assert sorted([queue.get(), queue.get()]) == [0, 1]
    queue.close()


@start_methods
@pytest.mark.parametrize("failing", [0, 1])
def test_exception_single(start_method: str | None, failing: int) -> None:
    with pytest.raises(
        Exception, match=rf"\nValueError: legitimate exception from process {failing}$"
    ):
        mp.start_processes(
            torch_ranks.exception_single, args=(failing,), nprocs=2, start_method=start_method
        )


@start_methods
def test_exception_all(start_method: str | None) -> None:
    with pytest.raises(Exception, match=r"\nValueError: legitimate exception from process (0|1)$"):
        mp.start_processes(torch_ranks.exception_all, nprocs=2, start_method=start_method)


@start_methods
def test_terminate_signal(start_method: str | None) -> None:
    with pytest.raises(Exception, match=r"process 0 terminated with signal (SIGABRT|SIGIOT)"):
        mp.start_processes(torch_ranks.terminate_signal, nprocs=2, start_method=start_method)


@start_methods
@pytest.mark.parametrize("grace_period", [None, 20])
def test_terminate_exit(start_method: str | None, grace_period: float | None) -> None:
    ctx = mp.start_processes(
        torch_ranks.terminate_exit, args=(123,), nprocs=2, join=False, start_method=start_method
    )
    pid1 = ctx.processes[1].pid
    # Where torch's tests listen (their assertLogs() defaults to the "torch" logger).
    with (
        recorders("torch") as seen,
        pytest.raises(Exception, match="process 0 terminated with exit code 123"),
    ):
        join_until_done(ctx, grace_period=grace_period)
    warnings = [record for record in seen["torch"].records if record.levelno >= logging.WARNING]
    if grace_period is None:
        # Rank 1 sleeps 2 s: it is terminated at once, and that is the first warning.
        assert warnings, "expected the SIGTERM warning on torch's logger"
        assert f"Terminating process {pid1} via signal" in warnings[0].getMessage()
        assert warnings[0].name == "torch.multiprocessing.spawn"
    else:
        # Rank 1 exits by itself well inside the grace period: nothing to warn about.
        assert warnings == []
    for process in ctx.processes:
        assert not process.is_alive()


@start_methods
def test_success_first_then_exception(start_method: str | None) -> None:
    with pytest.raises(Exception, match="ValueError: legitimate exception"):
        mp.start_processes(
            torch_ranks.success_first_then_exception,
            args=(123,),
            nprocs=2,
            start_method=start_method,
        )


def test_exception_raises() -> None:
    # fn(0) misses its second argument: a TypeError in the rank.
    with pytest.raises(mp.ProcessRaisedException):
        mp.spawn(torch_ranks.success_first_then_exception, args=(), nprocs=1)


def test_signal_raises() -> None:
    ctx = mp.spawn(torch_ranks.infinite_task, args=(), nprocs=1, join=False)
    for pid in ctx.pids():
        os.kill(pid, signal.SIGTERM)
    with pytest.raises(mp.ProcessExitedException):
        ctx.join()


def test_errors_pickleable() -> None:
    for error in [
        mp.ProcessRaisedException("Oh no!", 1, 1),
        mp.ProcessExitedException("Oh no!", 1, 1, 1),
    ]:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert (copy.msg, copy.error_index, copy.error_pid) == ("Oh no!", 1, 1)
    assert pickle.loads(pickle.dumps(mp.ProcessExitedException("Oh no!", 1, 1, 1))).exit_code == 1
