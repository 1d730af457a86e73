"""The launcher's supervision of one run: the group, its signals, its status line."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import tempfile
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

import aiospawn
from aiospawn._core._shutdown import DEFAULT_GRACE_PERIOD

from ._errorfile import write_root_cause
from ._parse import SHUTDOWN_SIGNALS, STATUS_RANKS
from ._plan import error_file
from ._report import Run, report, say
from ._status import StatusLine, wanted

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from aiospawn import AsyncProcessContext, GroupOptions
    from aiospawn._core._backend import Backend

    from ._plan import Plan

__all__ = ["STOPPING", "start_group", "supervise"]


async def supervise(plan: Plan) -> int:
    """Start the ranks, supervise them to the end, and report; return the exit status."""
    # A warm template takes our environment when it starts, and imports the
    # preload with it: the thread counts the ranks get must be there already.
    os.environ.update(plan.template_env)
    run = Run(plan)
    # Error files are local files: on Ray the ranks' nodes may be other machines.
    # Only named, not made: a file exists only once a rank records an error
    # (torch's @record), so a launcher killed outright leaves nothing behind
    # in the common case. The random part keeps others from guessing the name.
    error_files = (
        None
        if plan.ray is not None
        else os.path.join(tempfile.gettempdir(), f"aiospawn-{secrets.token_hex(8)}")
    )
    status = StatusLine(plan.nprocs) if wanted(plan.status, plan.nprocs, STATUS_RANKS) else None
    try:
        with anyio.open_signal_receiver(*plan.signals) as received:
            async with anyio.create_task_group() as tasks:
                ranks_scope = anyio.CancelScope()
                tasks.start_soon(_on_signals, received, run, ranks_scope)
                with ranks_scope:
                    try:
                        run.group = await start_group(plan, error_files)
                    except (TypeError, ValueError) as exc:  # raised before anything starts
                        run.usage_error = exc
                    except Exception as exc:
                        run.start_error = exc
                    else:
                        if status is not None:
                            status.open()
                            tasks.start_soon(status.follow, run.group)
                        try:
                            await run.group.join()
                        except aiospawn.ProcessException as exc:
                            run.failure = exc
                run.finished = True
                run.done.set()
                tasks.cancel_scope.cancel()
        if status is not None:
            status.close()
        write_root_cause(run.failure, error_files)
        return report(run)
    finally:
        if status is not None:
            status.close()
        if error_files is not None:
            for rank in range(plan.nprocs):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(error_file(error_files, rank))


async def start_group(
    plan: Plan,
    error_files: str | None,
    round_env: Callable[[int], dict[str, str]] | None = None,
) -> AsyncProcessContext[Any]:
    """Start the plan's ranks on this machine, not joined: the group's owner drives them.

    Args:
        plan: What to run.
        error_files: The directory of the ranks' error files, if any.
        round_env: Torchrun's variables of a multi-node round, per local rank.

    Raises:
        TypeError, ValueError: The options are refused, before anything starts.
    """
    return await aiospawn.start_processes(
        plan.fn,
        plan.args,
        plan.nprocs,
        join=False,
        start_method=plan.start_method,
        **_group_options(plan, error_files, round_env),
    )


def _group_options(
    plan: Plan,
    error_files: str | None,
    round_env: Callable[[int], dict[str, str]] | None,
) -> GroupOptions:
    """The group's options; ``round_env``: torchrun's variables of a multi-node round."""
    stdout, stderr = plan.stream_modes()
    options: GroupOptions = {
        "grace_period": plan.grace_period,
        "env": plan.environment(error_files, round_env),
        "torchrun_env": True,
        "restart": plan.restart,
        "heartbeat_timeout": plan.heartbeat_timeout,
        "startup_timeout": plan.startup_timeout,
        "stdout": stdout,
        "stderr": stderr,
        "tee": plan.teed,
        "prefix": plan.prefix,
        "devices_per_rank": plan.devices_per_rank,
        "devices": plan.devices,
        "backend": _backend(plan),
    }
    if plan.preload:
        options["preload"] = plan.preload
    return options


def _backend(plan: Plan) -> Backend | None:
    if plan.ray is None:
        return None
    # Ray folds identical lines of different workers into one ("[repeated 2x
    # across cluster]"): each rank's lines must all be shown.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stdout.isatty():
        # Ray colours its "(rank0 pid=...)" prefix even for a pipe or a file.
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    from aiospawn.ray import RayBackend

    return RayBackend(address=plan.ray, placement=plan.placement)


async def _on_signals(
    received: AsyncIterator[signal.Signals], run: Run, ranks_scope: anyio.CancelScope
) -> None:
    """Act on each signal received until the run ends; signals passed on finish first."""
    async with anyio.create_task_group() as passing_on:
        await _take_signals(received, run, ranks_scope, passing_on)


async def _take_signals(
    received: AsyncIterator[signal.Signals],
    run: Run,
    ranks_scope: anyio.CancelScope,
    passing_on: anyio.abc.TaskGroup,
) -> None:
    """The first signal stops the ranks or is passed on; a second SIGINT kills them now."""
    async for signum in received:
        if run.finished:
            continue  # every rank has been reaped: the outcome stands
        if not run.signals:
            run.signals.append(signum)
            grace = run.plan.grace_period
            until = "30 s" if grace is None else f"{grace:g} s"
            name = signal.Signals(signum).name
            if signum in STOPPING:
                say(
                    f"{name} received: stopping the ranks (SIGTERM, then SIGKILL after"
                    f" {until}; Ctrl-C again kills them now)"
                )
                ranks_scope.cancel()
            else:
                say(
                    f"{name} received: sent on to the ranks, which have {until} to exit"
                    " before SIGKILL"
                )
                passing_on.start_soon(_pass_on, run, signum, ranks_scope)
        elif signum == signal.SIGINT:
            run.signals.append(signum)
            say("SIGINT again: killing the ranks now")
            if run.group is not None:
                await run.group.terminate(grace_period=0)  # hurries the shutdown under way


#: The signals that stop the ranks with SIGTERM; others are passed on as they are.
STOPPING = frozenset(int(getattr(signal, name)) for name in SHUTDOWN_SIGNALS)


async def _pass_on(run: Run, signum: int, ranks_scope: anyio.CancelScope) -> None:
    """Send ``signum`` to every running rank, give them the grace period, then stop them.

    As torchrun does with a signal of ``--signals-to-handle``: SLURM sends
    SIGUSR1 ahead of a preemption, and the ranks checkpoint on it.
    """
    group = run.group
    if group is not None:
        group.send_signal(signum)
    grace = run.plan.grace_period
    with anyio.move_on_after(DEFAULT_GRACE_PERIOD if grace is None else grace):
        await run.done.wait()
    if not run.finished:
        ranks_scope.cancel()
        if group is not None:
            await group.terminate(grace_period=0)
