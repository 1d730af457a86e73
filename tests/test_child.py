"""The rank bootstrap (``aiospawn._rank.bootstrap``), proven on real processes.

The crash matrix walks the exit-code contract in the bootstrap's docstring row by
row, for every start method: rank 1 misbehaves while rank 0 sleeps (or both
ranks do a row that succeeds), and each row asserts the exception, its fields,
its message, and that every rank was reaped.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import psutil
import pytest

import aiospawn
from tests import ranks
from tests.helpers import receive, tripwire

pytestmark = pytest.mark.anyio

START_METHODS = ["spawn", "forkserver", "fork"]

RAISED_HEAD = re.escape("\n\n-- Process 1 terminated with the following error:\n") + (
    r"Traceback \(most recent call last\):\n.*"
)


def remote_traceback_of(type_name: str) -> Callable[[BaseException | None, str], None]:
    def check(cause: BaseException | None, message: str) -> None:
        assert isinstance(cause, aiospawn.RemoteTraceback)
        assert cause.type_name == type_name
        assert cause.traceback.startswith("Traceback (most recent call last):\n")
        assert message.endswith(cause.traceback)  # the message carries the same text
        assert type_name in str(cause)

    return check


def value_error(cause: BaseException | None, message: str) -> None:
    assert type(cause) is ValueError
    assert cause.args == ("bad shard 1",)


def keyboard_interrupt(cause: BaseException | None, message: str) -> None:
    assert type(cause) is KeyboardInterrupt


def unpicklable_value(cause: BaseException | None, message: str) -> None:
    assert type(cause) is TypeError
    assert "the value returned by the rank cannot be pickled" in str(cause)


@dataclass(frozen=True)
class Row:
    """One row of the contract: what rank 1 does, and what the supervisor reports.

    ``raises=None`` rows succeed: both ranks do the row and ``results`` is
    expected. Otherwise rank 1 does it, ``exit_code`` is its process's exit
    code, and ``message`` must match the exception's whole message.
    """

    behaviour: str
    raises: type[aiospawn.ProcessException] | None = None
    exit_code: int = 0
    signal_name: str | None = None
    message: str = ""
    cause: Callable[[BaseException | None, str], None] | None = None
    results: tuple[Any, ...] = (None, None)
    #: The process's own exit code, when it differs from the reported one.
    process_exit_code: int | None = None


Exited = aiospawn.ProcessExitedException
Raised = aiospawn.ProcessRaisedException

CRASH_MATRIX = [
    Row("return", results=(("value", 0), ("value", 1))),
    Row("sys.exit()"),
    Row("sys.exit(0)"),
    Row("os._exit(0)"),
    Row(
        "sys.exit(3)",
        Exited,
        exit_code=3,
        message=re.escape("process 1 terminated with exit code 3"),
    ),
    Row(
        "sys.exit(text)",
        Exited,
        exit_code=1,
        message=re.escape("process 1 terminated with exit code 1: sys.exit('crash text')"),
    ),
    Row(
        # The status keeps 8 bits: the rank exits with 1, the report keeps 256.
        "sys.exit(256)",
        Exited,
        exit_code=256,
        process_exit_code=1,
        message=re.escape(
            "process 1 terminated with exit code 256: sys.exit(256); the process's exit"
            " status is 1, as an exit status holds 0 to 255"
        ),
    ),
    Row(
        "closerange, return",
        Exited,
        exit_code=86,
        message=re.escape(
            "process 1 terminated with exit code 86: the rank's code closed the pipe on which"
            " it reports how fn ended"
        )
        + ".*outcome is lost.*",
    ),
    Row(
        "os._exit(7)",
        Exited,
        exit_code=7,
        message=re.escape("process 1 terminated with exit code 7"),
    ),
    Row(
        "segfault",
        Exited,
        exit_code=-signal.SIGSEGV,
        signal_name="SIGSEGV",
        message=re.escape("process 1 terminated with signal SIGSEGV"),
    ),
    Row(
        "SIGKILL",
        Exited,
        exit_code=-signal.SIGKILL,
        signal_name="SIGKILL",
        message=re.escape("process 1 terminated with signal SIGKILL (aiospawn did not send it;")
        + r" the out-of-memory killer is the usual cause.*\)",
    ),
    Row(
        # Not sent by aiospawn: no "sent by aiospawn", and no OOM hint either.
        "SIGTERM",
        Exited,
        exit_code=-signal.SIGTERM,
        signal_name="SIGTERM",
        message=re.escape("process 1 terminated with signal SIGTERM"),
    ),
    Row(
        # A KeyboardInterrupt in fn is a failure, not a clean exit.
        "KeyboardInterrupt",
        Raised,
        exit_code=1,
        message=RAISED_HEAD + r"\nKeyboardInterrupt\n",
        cause=keyboard_interrupt,
    ),
    Row(
        "raise ValueError",
        Raised,
        exit_code=1,
        message=RAISED_HEAD + re.escape("\nValueError: bad shard 1\n"),
        cause=value_error,
    ),
    Row(
        "return lock",
        Raised,
        exit_code=1,
        message=RAISED_HEAD
        + re.escape(
            "\nTypeError: the value returned by the rank cannot be pickled:"
            " cannot pickle '_thread.lock' object\n"
        ),
        cause=unpicklable_value,
    ),
    Row(
        "return lambda",
        Raised,
        exit_code=1,
        message=RAISED_HEAD
        + re.escape("\nTypeError: the value returned by the rank cannot be pickled: ")
        + r".*lambda.*\n",
        cause=unpicklable_value,
    ),
    Row(
        "raise unpicklable",
        Raised,
        exit_code=1,
        message=RAISED_HEAD + re.escape("\ntests.ranks.CrashLockedError: locked shard 1\n"),
        cause=remote_traceback_of("tests.ranks.CrashLockedError"),
    ),
    Row(
        "raise unloadable",
        Raised,
        exit_code=1,
        message=RAISED_HEAD + re.escape("\ntests.ranks.CrashNeedsTwoArgsError: shard 1: torn\n"),
        cause=remote_traceback_of("tests.ranks.CrashNeedsTwoArgsError"),
    ),
]


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize("row", [pytest.param(row, id=row.behaviour) for row in CRASH_MATRIX])
async def test_crash_matrix(row: Row, start_method: str) -> None:
    failing = None if row.raises is None else 1
    ctx = await aiospawn.start_processes(
        ranks.crash_row,
        (row.behaviour, failing),
        nprocs=2,
        join=False,
        start_method=start_method,
        grace_period=0.2,
    )
    pids = ctx.pids()
    assert len(pids) == 2
    if row.raises is None:
        with tripwire(60, f"join() of a group whose ranks did {row.behaviour}"):
            assert await ctx.join() is True
        assert ctx.results == list(row.results)
        assert [p.exitcode for p in ctx.processes] == [0, 0]
    else:
        with (
            tripwire(60, f"join() of a group whose rank 1 did {row.behaviour}"),
            pytest.raises(row.raises) as info,
        ):
            await ctx.join()
        error = info.value
        assert type(error) is row.raises
        assert (error.error_index, error.error_pid) == (1, pids[1])
        assert str(error) == error.msg
        assert re.fullmatch(row.message, error.msg, re.DOTALL), error.msg
        if isinstance(error, aiospawn.ProcessExitedException):
            assert (error.exit_code, error.signal_name) == (row.exit_code, row.signal_name)
        if row.cause is not None:
            row.cause(error.__cause__, error.msg)
        expected = row.exit_code if row.process_exit_code is None else row.process_exit_code
        assert ctx.processes[1].exitcode == expected
        # The sleeping sibling was stopped by the shutdown after the grace period.
        assert ctx.processes[0].exitcode == -signal.SIGTERM
    for pid in pids:
        assert not psutil.pid_exists(pid), f"rank pid {pid} was not reaped"


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_each_rank_leads_its_own_process_group(start_method: str) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            ranks.crash_report_group,
            (writer,),
            nprocs=2,
            join=False,
            start_method=start_method,
            grace_period=2,
        )
        try:
            reported = [await receive(reader, "rank ready") for _ in range(2)]
            assert sorted(rank for rank, _, _ in reported) == [0, 1]
            for _rank, pid, pgid in reported:
                assert pgid == pid
                # Seen from here too, while the rank runs.
                assert os.getpgid(pid) == pid != os.getpgid(0)
            assert sorted(pid for _, pid, _ in reported) == sorted(ctx.pids())
        finally:
            await ctx.terminate()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_fork_rank_gets_default_signal_handling_back() -> None:
    """A fork copies the supervisor's handlers, wakeup fd and the forking thread's mask.

    The supervisor here has what an asyncio service has: a loop signal handler
    (a Python handler plus the loop's wakeup fd), Python-level SIGINT and
    SIGTERM handlers, and a blocked signal (which the worker threads that
    start ranks inherit).
    """
    loop = asyncio.get_running_loop()
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    loop.add_signal_handler(signal.SIGUSR1, lambda: None)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        # The precondition: a worker thread of this loop has SIGUSR2 blocked.
        worker_mask = await anyio.to_thread.run_sync(signal.pthread_sigmask, signal.SIG_BLOCK, ())
        assert signal.SIGUSR2 in worker_mask
        with reader, writer:
            await aiospawn.start_processes(
                ranks.crash_report_signals, (writer,), nprocs=1, start_method="fork"
            )
            report = await receive(reader, "signal report")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        loop.remove_signal_handler(signal.SIGUSR1)
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert report == {
        "SIGINT": True,  # default_int_handler
        "SIGTERM": True,  # SIG_DFL
        "SIGUSR1": True,  # SIG_DFL
        "SIGPIPE": True,  # still ignored, as in any Python program
        "mask": [],
        "wakeup_fd": -1,
    }


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_the_guard_thread_blocks_every_signal_so_the_rank_gets_its_own(
    start_method: str,
) -> None:
    # Python runs signal handlers in the main thread only; a SIGTERM the kernel
    # handed to the guard thread would leave a rank's handler waiting forever.
    [masks] = await aiospawn.start_processes(
        ranks.child_thread_signal_masks, start_method=start_method
    )
    catchable = {int(signum) for signum in signal.valid_signals()} - {
        signal.SIGKILL,
        signal.SIGSTOP,
    }
    assert len(masks) == 1, masks  # the guard thread, nothing else
    [mask] = masks.values()
    assert all(mask & (1 << (signum - 1)) for signum in catchable)


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_ten_megabytes_of_output_before_failing_are_no_obstacle(start_method: str) -> None:
    # The rank blocks on a full stdout unless someone reads it; pytest's capture does.
    with (
        tripwire(60, "join() of a group whose rank 1 printed 10 MB, then raised"),
        pytest.raises(aiospawn.ProcessRaisedException) as info,
    ):
        await aiospawn.start_processes(
            ranks.crash_print_then_raise,
            (10,),
            nprocs=2,
            start_method=start_method,
            grace_period=0.5,
        )
    assert info.value.error_index == 1
    value_error(info.value.__cause__, info.value.msg)


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize("behaviour", ["ignores SIGTERM", "hangs in C, SIGTERM blocked"])
async def test_a_sibling_that_will_not_stop_is_killed_after_the_grace_period(
    behaviour: str, start_method: str
) -> None:
    context = multiprocessing.get_context(start_method)
    release = context.Event()
    reader, writer = context.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            ranks.crash_stubborn_sibling,
            (behaviour, writer, release),
            nprocs=2,
            join=False,
            start_method=start_method,
            grace_period=0.5,
        )
        assert await receive(reader, "rank 0 refusing SIGTERM") == "ready"
        release.set()
        with (
            tripwire(60, f"join() while rank 0 {behaviour}"),
            pytest.raises(aiospawn.ProcessRaisedException) as info,
        ):
            await ctx.join()
    assert info.value.error_index == 1  # the root cause, not the rank we killed
    assert [process.exitcode for process in ctx.processes] == [-signal.SIGKILL, 1]
    for pid in ctx.pids():
        assert not psutil.pid_exists(pid), f"rank pid {pid} was not reaped"
