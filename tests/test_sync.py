"""aiospawn.sync: the blocking torch-compatible API, and the torch defects it does not have.

torch's own test cases, ported, are in test_torch_compat.py. Here: the
module's contract (names, warnings, ``nprocs=0``, the context's attributes,
the loop thread's lifetime, refusing to block an event loop), then one test
per defect of ``torch.multiprocessing.spawn`` named for the behaviour we have
instead (research/torch.md, section 1.7).
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import aiospawn
import aiospawn._core._errors
import aiospawn._core._shutdown
import aiospawn.sync as sync
from aiospawn._core._context import group_of
from aiospawn._local._rank import LocalRank
from tests import ranks, slow_import_module, torch_ranks
from tests.helpers import is_running, live_children, recorders, wait_until

ROOT = Path(__file__).resolve().parent.parent


def _all_loop_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "aiospawn-sync-loop"}


_loop_threads_before: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _loop_threads_baseline() -> None:
    _loop_threads_before.clear()
    _loop_threads_before.update(_all_loop_threads())


def loop_threads() -> list[threading.Thread]:
    """The sync loop threads started by this test and still running."""
    return sorted(_all_loop_threads() - _loop_threads_before, key=lambda thread: thread.ident or 0)


def join_all(ctx: sync.ProcessContext, **kwargs: Any) -> None:
    while not ctx.join(**kwargs):
        pass


# The module's contract ----------------------------------------------------------


def test_public_names_are_torchs_and_the_exceptions_are_the_cores() -> None:
    assert sorted(sync.__all__) == sorted(
        [
            "ENV_VAR_PARALLEL_START",
            "ProcessContext",
            "ProcessException",
            "ProcessExitedException",
            "ProcessRaisedException",
            "SpawnContext",
            "spawn",
            "start_processes",
        ]
    )
    assert sync.ProcessException is aiospawn._core._errors.ProcessException
    assert sync.ProcessRaisedException is aiospawn._core._errors.ProcessRaisedException
    assert sync.ProcessExitedException is aiospawn._core._errors.ProcessExitedException
    assert sync.ProcessRaisedException is aiospawn.ProcessRaisedException
    assert sync.ENV_VAR_PARALLEL_START == "TORCH_MP_PARALLEL_START"
    assert issubclass(sync.SpawnContext, sync.ProcessContext)


@pytest.mark.parametrize("name", sorted(sync.__all__))
def test_every_public_name_is_documented(name: str) -> None:
    if name == "ENV_VAR_PARALLEL_START":  # a str has no docstring of its own
        assert name in (sync.__doc__ or "")
    else:
        assert inspect.getdoc(getattr(sync, name))


@pytest.mark.parametrize(
    "function",
    [
        sync.start_processes,
        sync.spawn,
        sync.ProcessContext.join,
        sync.ProcessContext.pids,
        sync.ProcessContext.terminate,
    ],
)
def test_public_functions_document_args_returns_and_raises(function: Callable[..., Any]) -> None:
    doc = inspect.getdoc(function) or ""
    if inspect.signature(function).parameters.keys() - {"self"}:
        assert "Args:" in doc
    if function is not sync.ProcessContext.terminate:  # returns None
        assert "Returns:" in doc
    if function is not sync.ProcessContext.pids:  # cannot fail
        assert "Raises:" in doc


def test_importing_sync_imports_neither_torch_nor_trio() -> None:
    code = "import sys, aiospawn.sync; print(sorted({'torch', 'trio'} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_spawn_context_is_a_deprecated_alias_that_warns_like_torch() -> None:
    message = "SpawnContext is renamed to ProcessContext since 1.4 release."
    with pytest.warns(UserWarning, match=re.escape(message)) as record:
        ctx = sync.SpawnContext()
    assert record[0].filename == __file__  # stacklevel=2: the caller's line
    assert isinstance(ctx, sync.ProcessContext)
    assert ctx.join() is True


def test_spawn_forces_the_spawn_start_method_with_torchs_future_warning() -> None:
    with pytest.warns(FutureWarning) as record:
        ctx = sync.spawn(torch_ranks.success, nprocs=1, join=False, start_method="fork")
    assert str(record[0].message) == (
        "This method only supports start_method=spawn (got: fork).\n"
        "To use a different start_method use:\n"
        "\t\t aiospawn.sync.start_processes(...)"
    )
    assert record[0].filename == __file__
    assert type(ctx.processes[0]) is multiprocessing.get_context("spawn").Process
    join_all(ctx)


def test_start_method_none_is_the_platform_default() -> None:
    ctx = sync.start_processes(torch_ranks.success, nprocs=1, join=False, start_method=None)
    default = multiprocessing.get_context(multiprocessing.get_start_method())
    assert type(ctx.processes[0]) is default.Process
    join_all(ctx)


def test_join_true_returns_none_and_join_false_a_context() -> None:
    assert sync.start_processes(torch_ranks.success, nprocs=2, start_method="fork") is None
    ctx = sync.start_processes(torch_ranks.success, nprocs=2, join=False, start_method="fork")
    assert isinstance(ctx, sync.ProcessContext)
    join_all(ctx)


def test_nprocs_zero_starts_nothing_and_joins_at_once_like_torch() -> None:
    assert sync.start_processes(torch_ranks.success, nprocs=0) is None
    ctx = sync.start_processes(torch_ranks.success, nprocs=0, join=False)
    assert ctx.join() is True
    assert (ctx.processes, ctx.error_files, ctx.sentinels, ctx.pids()) == ([], [], {}, [])
    assert loop_threads() == []
    with pytest.raises(ValueError, match="start_method must be one of"):
        sync.start_processes(torch_ranks.success, nprocs=0, start_method="thread")
    with pytest.raises(ValueError, match="nprocs must be a positive int, got -1"):
        sync.start_processes(torch_ranks.success, nprocs=-1)


def test_context_attributes_follow_each_join_like_torch() -> None:
    go = multiprocessing.get_context("fork").Event()
    ctx = sync.start_processes(
        torch_ranks.first_returns_then_wait, (go,), nprocs=2, join=False, start_method="fork"
    )
    assert ctx.pids() == [process.pid for process in ctx.processes]
    assert ctx.error_files == ["", ""]
    assert ctx.sentinels == {process.sentinel: rank for rank, process in enumerate(ctx.processes)}
    # Rank 0 returned while rank 1 waits: join() returns False after that one exit.
    assert ctx.join() is False
    assert ctx.sentinels == {ctx.processes[1].sentinel: 1}
    assert ctx.join(timeout=0.05) is False
    assert ctx.join(timeout=-1) is False  # torch polls on a negative timeout
    go.set()
    assert ctx.join() is True
    assert ctx.sentinels == {}
    assert ctx.join() is True
    assert "unjoined=0" in repr(ctx)


def test_escalation_logs_sigterm_then_sigkill_where_torch_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once torch is imported (by another test of this process), its own
    # set-up keeps the "torch" loggers' records from the root: not ours to check.
    monkeypatch.setattr(logging.getLogger("torch"), "propagate", True)
    fork = multiprocessing.get_context("fork")
    ready, go = fork.SimpleQueue(), fork.Event()
    ctx = sync.start_processes(
        torch_ranks.fail_on_go_sibling_ignores_sigterm,
        (ready, go),
        nprocs=2,
        join=False,
        start_method="fork",
    )
    _, pid1 = ready.get()
    go.set()
    with (
        recorders("", "aiospawn", "torch") as seen,
        pytest.raises(sync.ProcessRaisedException, match="rank 0 failed on purpose"),
    ):
        join_all(ctx, grace_period=0.3)
    warnings = [record for record in seen["torch"].records if record.levelno >= logging.WARNING]
    assert [record.name for record in warnings] == ["torch.multiprocessing.spawn"] * 2
    # Once at the root; the aiospawn logger's own handlers get the same records.
    assert [r for r in seen[""].records if r.levelno >= logging.WARNING] == warnings
    assert [r for r in seen["aiospawn"].records if r.levelno >= logging.WARNING] == warnings
    assert f"Terminating process {pid1} via signal SIGTERM" in warnings[0].getMessage()
    assert f"Process {pid1}" in warnings[1].getMessage()
    assert "SIGKILL" in warnings[1].getMessage()
    assert ctx.processes[1].exitcode == -signal.SIGKILL


@pytest.mark.parametrize("outcome", ["joined", "raised", "terminated"])
def test_the_loop_thread_ends_with_the_group(outcome: str) -> None:
    assert loop_threads() == []
    if outcome == "joined":
        ctx = sync.start_processes(torch_ranks.success, nprocs=2, join=False, start_method="fork")
        assert len(loop_threads()) == 1
        join_all(ctx)
    elif outcome == "raised":
        ctx = sync.start_processes(
            torch_ranks.exception_single, (0,), nprocs=2, join=False, start_method="fork"
        )
        assert len(loop_threads()) == 1
        with pytest.raises(sync.ProcessRaisedException):
            join_all(ctx)
    else:
        ctx = sync.start_processes(
            torch_ranks.infinite_task, nprocs=2, join=False, start_method="fork"
        )
        assert len(loop_threads()) == 1
        ctx.terminate(grace_period=5)
        ctx.terminate()  # idempotent
        with pytest.raises(sync.ProcessExitedException, match="signal SIGTERM") as info:
            ctx.join()
        assert info.value.error_index == 0
    assert loop_threads() == []
    assert not any(process.is_alive() for process in ctx.processes)


def test_terminate_after_success_changes_nothing() -> None:
    ctx = sync.start_processes(torch_ranks.success, nprocs=1, join=False, start_method="fork")
    join_all(ctx)
    ctx.terminate()
    assert ctx.join() is True


def test_terminate_from_another_thread_ends_a_blocked_join() -> None:
    ready = multiprocessing.get_context("fork").SimpleQueue()
    ctx = sync.start_processes(
        ranks.report_ready, (ready,), nprocs=2, join=False, start_method="fork"
    )
    for _ in range(2):
        ready.get()
    raised: list[BaseException] = []

    def join_in_thread() -> None:
        try:
            join_all(ctx)
        except BaseException as exc:
            raised.append(exc)

    joiner = threading.Thread(target=join_in_thread)
    joiner.start()
    ctx.terminate(grace_period=5)
    joiner.join(timeout=30)
    assert not joiner.is_alive(), "join() stayed blocked after terminate()"
    (error,) = raised
    assert isinstance(error, sync.ProcessExitedException)
    assert error.signal_name == "SIGTERM"
    assert loop_threads() == []


@pytest.mark.anyio
async def test_blocking_calls_refuse_to_run_inside_an_event_loop(anyio_backend: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: sync.start_processes(torch_ranks.success, nprocs=1),
        lambda: sync.spawn(torch_ranks.success, nprocs=1, join=False),
        lambda: sync.ProcessContext().join(),
        lambda: sync.ProcessContext().terminate(),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=f"runs an? {anyio_backend} event loop") as info:
            call()
        assert "await aiospawn.start_processes(...)" in str(info.value)
        assert "aiospawn.open_group(...)" in str(info.value)
    assert loop_threads() == []


@pytest.mark.anyio
async def test_blocking_calls_work_from_a_worker_thread_of_an_event_loop(
    anyio_backend: str,
) -> None:
    def run_group() -> None:
        # The context stays in this frame, which is gone once the thread's
        # call returns: nothing of the group outlives the test.
        ctx = sync.start_processes(torch_ranks.success, nprocs=2, join=False, start_method="fork")
        join_all(ctx)

    await anyio.to_thread.run_sync(run_group)
    await anyio.to_thread.run_sync(
        lambda: sync.start_processes(torch_ranks.success, nprocs=2, start_method="fork")
    )


# The defects of torch.multiprocessing.spawn that aiospawn.sync does not have -----


def test_a_failing_run_leaves_no_error_file_behind() -> None:
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(sync.ProcessRaisedException):
        sync.start_processes(torch_ranks.exception_all, nprocs=2, start_method="spawn")
    assert set(os.listdir(tempfile.gettempdir())) - before == set()


def test_no_pickle_is_read_from_a_path_another_user_could_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_files(*args: object) -> object:
        raise AssertionError("pickle.load() called on a file")

    monkeypatch.setattr(pickle, "load", no_files)
    before = set(os.listdir(tempfile.gettempdir()))
    ctx = sync.start_processes(
        torch_ranks.exception_single, (1,), nprocs=2, join=False, start_method="spawn"
    )
    with pytest.raises(sync.ProcessRaisedException) as info:
        join_all(ctx)
    # The traceback and the exception itself came back on the rank's pipe.
    assert isinstance(info.value.__cause__, ValueError)
    assert ctx.error_files == ["", ""]
    assert not any(os.path.exists(path) for path in ctx.error_files)
    assert set(os.listdir(tempfile.gettempdir())) - before == set()


@pytest.mark.parametrize("how", ["raises KeyboardInterrupt", "gets SIGINT"])
def test_a_rank_interrupted_by_keyboard_interrupt_is_reported_not_success(how: str) -> None:
    if how == "raises KeyboardInterrupt":
        with pytest.raises(sync.ProcessRaisedException, match="KeyboardInterrupt") as info:
            sync.start_processes(torch_ranks.raise_keyboard_interrupt, nprocs=1)
    else:
        ready = multiprocessing.get_context("spawn").SimpleQueue()
        ctx = sync.start_processes(ranks.report_ready, (ready,), nprocs=1, join=False)
        _, pid = ready.get()
        os.kill(pid, signal.SIGINT)
        with pytest.raises(sync.ProcessRaisedException, match="KeyboardInterrupt") as info:
            ctx.join()
    assert isinstance(info.value.__cause__, KeyboardInterrupt)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_ranks_survive_the_exit_of_the_thread_that_started_them(start_method: str) -> None:
    context = multiprocessing.get_context(start_method)
    ready, go = context.SimpleQueue(), context.Event()
    started: list[sync.ProcessContext] = []
    starter = threading.Thread(
        target=lambda: started.append(
            sync.start_processes(
                torch_ranks.wait_for_go,
                (ready, go),
                nprocs=2,
                join=False,
                start_method=start_method,
            )
        )
    )
    starter.start()
    starter.join()
    (ctx,) = started
    reported = sorted(ready.get() for _ in range(2))
    assert [pid for _, pid in reported] == ctx.pids()
    # torch's ranks get SIGINT (PR_SET_PDEATHSIG) as the starting thread exits,
    # swallow it and "succeed"; these are still waiting for the go.
    assert all(is_running(pid) for pid in ctx.pids())
    go.set()
    join_all(ctx)
    assert [process.exitcode for process in ctx.processes] == [0, 0]


DIE_WITH_PROCESS = """
import os, signal, sys, threading
import aiospawn.sync as mp
from tests import ranks

started = []
starter = threading.Thread(target=lambda: started.append(
    mp.start_processes(ranks.sleep_forever, nprocs=2, join=False, start_method=sys.argv[1])))
starter.start()
starter.join()
print(*started[0].pids(), flush=True)
if sys.argv[2] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
# else: the interpreter exits, the group still running and never joined
"""


@pytest.mark.parametrize(("start_method", "end"), [("spawn", "exit"), ("fork", "sigkill")])
def test_ranks_still_die_with_the_process(start_method: str, end: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DIE_WITH_PROCESS, start_method, end],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,  # a hang at interpreter exit would end here
        check=False,
    )
    assert done.returncode == (0 if end == "exit" else -signal.SIGKILL), done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    assert wait_until(lambda: not any(is_running(pid) for pid in pids), 10), (
        f"ranks {pids} outlived their supervising process"
    )


def interrupt_main_thread_when_ready(ready: Any, nprocs: int, pids: list[int]) -> None:
    for _ in range(nprocs):
        pids.append(ready.get()[1])
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signal.SIGINT)


@pytest.mark.parametrize(
    ("blocked_in", "start_method"),
    [("start_processes", "spawn"), ("start_processes", "fork"), ("join", "spawn")],
)
def test_keyboard_interrupt_in_the_parent_stops_the_ranks_before_it_propagates(
    blocked_in: str, start_method: str
) -> None:
    assert threading.current_thread() is threading.main_thread()
    ready = multiprocessing.get_context(start_method).SimpleQueue()
    pids: list[int] = []
    interrupter = threading.Thread(
        target=interrupt_main_thread_when_ready, args=(ready, 2, pids), daemon=True
    )
    started: list[sync.ProcessContext] = []

    def run_group() -> None:
        if blocked_in == "start_processes":
            sync.start_processes(ranks.report_ready, (ready,), nprocs=2, start_method=start_method)
        else:
            started.append(
                sync.start_processes(
                    ranks.report_ready, (ready,), nprocs=2, join=False, start_method=start_method
                )
            )
            join_all(started[0])

    # Ctrl-C's handler, even where pytest runs with SIGINT ignored (a background job).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_group()
    finally:
        signal.signal(signal.SIGINT, previous)
    # Checked at once, no retry: the ranks were reaped before the exception left.
    assert len(pids) == 2
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert loop_threads() == []
    interrupter.join()
    for ctx in started:
        with pytest.raises(sync.ProcessExitedException, match="sent by aiospawn"):
            ctx.join()


def test_a_failed_start_stops_the_ranks_already_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    children = live_children()
    with pytest.raises(pickle.PicklingError, match="pickles only once") as info:
        sync.start_processes(
            torch_ranks.sleep_forever_with,
            (torch_ranks.PicklesOnce(),),
            nprocs=3,
            start_method="spawn",
        )
    assert any("raised while starting rank" in note for note in info.value.__notes__)
    # The one rank whose arguments pickled was started, then stopped and reaped.
    stopped = [record for record in caplog.records if "Terminating process" in record.message]
    assert len(stopped) == 1
    assert live_children() == children
    assert loop_threads() == []


def test_join_is_idempotent_after_a_failure() -> None:
    ctx = sync.start_processes(torch_ranks.exception_all, nprocs=2, join=False, start_method="fork")
    errors = []
    for _ in range(3):
        with pytest.raises(sync.ProcessRaisedException) as info:
            join_all(ctx)
        errors.append(info.value)
    assert len({(type(e), e.error_index, e.error_pid, str(e)) for e in errors}) == 1
    assert all(isinstance(error.__cause__, ValueError) for error in errors)
    assert errors[0] is not errors[1]


@pytest.mark.alone  # it bounds a duration
def test_the_shutdown_after_an_undelivered_sigkill_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aiospawn._core._shutdown, "REAP_TIMEOUT", 0.5)
    send_signal = LocalRank.send_signal

    def lose_sigkill(self: LocalRank, signum: int) -> bool:
        if signum == signal.SIGKILL:  # claimed as sent; never delivered
            return self.poll() is None
        return send_signal(self, signum)

    monkeypatch.setattr(LocalRank, "send_signal", lose_sigkill)
    fork = multiprocessing.get_context("fork")
    ready, go = fork.SimpleQueue(), fork.Event()
    ctx = sync.start_processes(
        torch_ranks.fail_on_go_sibling_ignores_sigterm,
        (ready, go),
        nprocs=2,
        join=False,
        start_method="fork",
    )
    _, pid1 = ready.get()
    go.set()
    started = time.monotonic()
    try:
        with pytest.raises(sync.ProcessRaisedException, match="rank 0 failed on purpose") as info:
            join_all(ctx, grace_period=0.2)
        # Bounded by the patched reap timeout (the default alone is 5 s).
        assert time.monotonic() - started < 4
        assert any("did not exit after SIGKILL" in note for note in info.value.__notes__)
        assert is_running(pid1)  # the SIGKILL really was lost
        with pytest.raises(sync.ProcessRaisedException, match="rank 0 failed on purpose"):
            ctx.join()
        assert ctx.sentinels == {ctx.processes[1].sentinel: 1}
    finally:
        monkeypatch.undo()
        os.kill(pid1, signal.SIGKILL)
        # Let the core's watcher reap the rank and close its pidfd and pipe.
        assert ctx._group is not None
        anyio.run(group_of(ctx._group).attempt(1).wait, backend="asyncio")


def test_join_counts_an_exit_that_happened_between_calls() -> None:
    async def join_returns_at_once() -> bool:
        ctx = await aiospawn.start_processes(
            torch_ranks.first_returns_then_sleep, nprocs=2, join=False, start_method="fork"
        )
        try:
            # Wait until rank 0 can be reaped, without reaping it: its pidfd
            # turns readable once every thread of it has gone (a zombie whose
            # guard thread is still exiting cannot be reaped yet).
            pidfd = os.pidfd_open(ctx.pids()[0])
            try:
                assert select.select([pidfd], [], [], 30)[0], "rank 0 did not return"
            finally:
                os.close(pidfd)
            with anyio.move_on_after(1):
                return await group_of(ctx).wait_step(None, None) is False
            return False
        finally:
            await ctx.terminate(grace_period=5)

    assert anyio.run(join_returns_at_once, backend="asyncio")


@pytest.mark.parametrize("parallel_start", ["0", "1"])
@pytest.mark.alone  # it bounds a duration
def test_ranks_start_concurrently_whatever_torch_mp_parallel_start_says(
    monkeypatch: pytest.MonkeyPatch, parallel_start: str
) -> None:
    # Each forkserver rank takes 1 s to import fn's module while its start
    # blocks on the 1 MB argument: one start at a time would take over 4 s.
    monkeypatch.setenv(sync.ENV_VAR_PARALLEL_START, parallel_start)
    payload = b"x" * (1 << 20)
    started = time.monotonic()
    sync.start_processes(
        slow_import_module.payload_size, (payload,), nprocs=4, start_method="forkserver"
    )
    elapsed = time.monotonic() - started
    assert elapsed < 4.0, f"4 ranks took {elapsed:.1f} s to start and finish"
