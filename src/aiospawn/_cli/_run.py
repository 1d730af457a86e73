"""The launcher's supervision of one run: the group, its outcome, and the signals received."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import anyio

import aiospawn

from ._parse import SHUTDOWN_SIGNALS
from ._report import Run, report, say

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["supervise"]


async def supervise(plan: Plan) -> int:

    run = Run(plan)
    signums = [getattr(signal, name) for name in SHUTDOWN_SIGNALS]
    with anyio.open_signal_receiver(*signums) as received:
        async with anyio.create_task_group() as tasks:
            ranks_scope = anyio.CancelScope()
            tasks.start_soon(_on_signals, received, run, ranks_scope)
            with ranks_scope:
                try:
                    run.group = await aiospawn.start_processes(
                        plan.fn,
                        plan.args,
                        plan.nprocs,
                        join=False,
                        start_method=plan.start_method,
                        grace_period=plan.grace_period,
                        env=plan.env,
                        torchrun_env=True,
                        restart=plan.restart,
                        stdout=plan.stdout,
                        stderr=plan.stderr,
                        tee=plan.tee,
                    )
                except (TypeError, ValueError) as exc:  # raised before anything starts
                    run.usage_error = exc
                except Exception as exc:
                    run.start_error = exc
                else:
                    try:
                        await run.group.join()
                    except aiospawn.ProcessException as exc:
                        run.failure = exc
            run.finished = True
            tasks.cancel_scope.cancel()
    return report(run)


async def _on_signals(received: Any, run: Run, ranks_scope: Any) -> None:

    async for signum in received:
        if run.finished:
            continue  # every rank has been reaped: the outcome stands
        if not run.signals:
            run.signals.append(signum)
            grace = run.plan.grace_period
            until = "30 s" if grace is None else f"{grace:g} s"
            say(
                f"{signal.Signals(signum).name} received: stopping the ranks (SIGTERM, then"
                f" SIGKILL after {until}; Ctrl-C again kills them now)"
            )
            ranks_scope.cancel()
        elif signum == signal.SIGINT:
            run.signals.append(signum)
            say("SIGINT again: killing the ranks now")
            if run.group is not None:
                await run.group.terminate(grace_period=0)  # hurries the shutdown under way
