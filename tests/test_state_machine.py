"""Property-based tests of a group's life: random operations, checked after every step.

Hypothesis draws a group size and a list of operations; each example runs them
in one ``anyio.run`` against a group of ``fork`` ranks that wait for a command
(``ranks.rel_obey``: return a value, ``sys.exit(n)``, or raise), so that the
test decides when and how each rank ends. After a command the test waits, on
a pidfd of its own, until the rank has exited (not reaped: that is the
library's job), so the model below knows the exact state before the next step.

Operations: command a rank, ``join(timeout=0)`` / ``join(timeout=0.01)``,
``terminate()``, cancel a ``join()`` that is waiting, read ``results``.
After every step:

* once a shutdown has completed (terminate, a cancelled join, a join that
  raised), no rank is running and every rank has been reaped, with exit code
  -15 for those we stopped;
* ``join()`` gives the same outcome twice in a row, and once it has raised,
  every later call raises an equal exception;
* the reported root cause is a rank that failed by itself whenever one did,
  never a rank we terminated;
* ``results`` is available only after ``join()`` returned True, and then holds
  what the ranks returned.

``AIOSPAWN_STRESS`` scales the number of examples of the slow variant.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import aiospawn
from tests import ranks
from tests.helpers import live_children, open_fds

STRESS = float(os.environ.get("AIOSPAWN_STRESS", "1"))
BACKENDS = ["asyncio", "trio"]

# --- operations ------------------------------------------------------------------

commands = st.one_of(
    st.tuples(st.just("return"), st.integers(-3, 3)),
    st.tuples(st.just("exit"), st.integers(0, 3)),
    st.tuples(st.just("raise"), st.sampled_from(["bad shard", "out of memory"])),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("command"), st.integers(0, 2), commands),
        st.tuples(st.just("join"), st.sampled_from([0, 0.01])),
        st.just(("terminate",)),
        st.just(("cancel_join",)),
        st.just(("results",)),
    ),
    max_size=10,
)


# --- the model ---------------------------------------------------------------------


@dataclass
class Model:
    """What the group must look like, from the operations done so far."""

    nprocs: int
    #: per rank: "running", "returned" (exit 0), "failed" (by itself) or "stopped" (by us)
    status: list[str] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    #: the command each rank obeyed
    commanded: dict[int, tuple[str, Any]] = field(default_factory=dict)
    #: a shutdown has completed: nothing may run any more
    shut_down: bool = False
    joined_true: bool = False
    #: the first exception join() raised, as (class name, error_index, message)
    raised: tuple[str, int, str] | None = None

    def __post_init__(self) -> None:
        self.status = ["running"] * self.nprocs
        self.values = [None] * self.nprocs

    def obey(self, rank: int, command: tuple[str, Any]) -> None:
        what, arg = command
        self.commanded[rank] = command
        if what == "return" or (what == "exit" and arg == 0):
            self.status[rank] = "returned"
            self.values[rank] = arg if what == "return" else None
        else:
            self.status[rank] = "failed"

    def stop_the_rest(self) -> None:
        self.status = ["stopped" if s == "running" else s for s in self.status]
        self.shut_down = True

    def join_blocks(self) -> bool:
        """Would join() (no timeout) wait for running ranks?"""
        failed = "failed" in self.status
        return not failed and not self.shut_down and "running" in self.status


def signature(exc: aiospawn.ProcessException) -> tuple[str, int, str]:
    return type(exc).__name__, exc.error_index, str(exc)


# --- running an example ------------------------------------------------------------


class Example:
    def __init__(self, ctx: aiospawn.AsyncProcessContext[Any], model: Model, writers: list[Any]):
        self.ctx = ctx
        self.model = model
        self.writers = writers
        self.pids = ctx.pids()
        self.pidfds = [os.pidfd_open(pid) for pid in self.pids]
        self.steps: list[str] = []

    def close(self) -> None:
        for fd in self.pidfds:
            os.close(fd)

    async def command(self, rank: int, command: tuple[str, Any]) -> None:
        rank %= self.model.nprocs
        if self.model.status[rank] != "running":
            return
        self.writers[rank].send(command)
        with anyio.fail_after(30):  # tripwire: the rank never obeyed
            await anyio.wait_readable(self.pidfds[rank])  # exited, not reaped
        self.model.obey(rank, command)

    async def join(self, seconds: float | None) -> tuple[str, Any]:
        try:
            return "returned", await self.ctx.join(timeout=seconds)
        except aiospawn.ProcessException as exc:
            return "raised", exc

    async def join_twice(self, seconds: float) -> None:
        first = await self.join(seconds)
        self.check_join(first)
        second = await self.join(seconds)
        self.check_join(second)
        assert _comparable(first) == _comparable(second), "join() changed its mind"

    def check_join(self, outcome: tuple[str, Any]) -> None:
        model = self.model
        kind, value = outcome
        event(f"join: {type(value).__name__ if kind == 'raised' else value}")
        failed = [rank for rank, s in enumerate(model.status) if s == "failed"]
        if failed:
            assert kind == "raised", f"ranks {failed} failed, yet join() returned {value!r}"
            self.check_root(value, failed)
            model.stop_the_rest()
        elif model.shut_down and "stopped" in model.status:
            assert kind == "raised", f"join() after a shutdown returned {value!r}"
            stopped = model.status.index("stopped")
            assert isinstance(value, aiospawn.ProcessExitedException)
            assert (value.error_index, value.exit_code, value.signal_name) == (
                stopped,
                -15,
                "SIGTERM",
            )
            assert "sent by aiospawn" in str(value)
        elif all(s == "returned" for s in model.status):
            assert outcome == ("returned", True)
            model.joined_true = True
        else:
            assert outcome == ("returned", False)
        if kind == "raised":
            if model.raised is None:
                model.raised = signature(value)
            assert signature(value) == model.raised, "join() raised a different exception"

    def check_root(self, exc: aiospawn.ProcessException, failed: list[int]) -> None:
        rank = exc.error_index
        assert rank in failed, f"root cause rank {rank} did not fail by itself ({failed})"
        what, arg = self.model.commanded[rank]
        if what == "raise":
            assert isinstance(exc, aiospawn.ProcessRaisedException)
            assert isinstance(exc.__cause__, ValueError)
            assert str(exc.__cause__) == arg
        else:
            assert isinstance(exc, aiospawn.ProcessExitedException)
            assert exc.exit_code == arg

    async def terminate(self) -> None:
        await self.ctx.terminate(grace_period=5)
        self.model.stop_the_rest()

    async def cancel_join(self) -> None:
        blocks = self.model.join_blocks()
        outcome: list[tuple[str, Any]] = []

        async def join() -> None:
            outcome.append(await self.join(None))

        async with anyio.create_task_group() as tg:
            tg.start_soon(join)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        event(f"cancel_join: {'cancelled while waiting' if blocks else 'finished first'}")
        if blocks:
            assert outcome == [], f"join() should have been waiting, got {outcome}"
            self.model.stop_the_rest()  # cancelling join() shuts the group down
        else:
            assert len(outcome) == 1, "join() should not have waited"
            self.check_join(outcome[0])

    def results(self) -> None:
        if self.model.joined_true:
            assert self.ctx.results == self.model.values
        else:
            with pytest.raises(RuntimeError, match="join"):
                _ = self.ctx.results

    def check_invariants(self) -> None:
        if self.model.shut_down:
            left = live_children() & set(self.pids)
            assert not left, f"ranks still running or unreaped after a shutdown: {left}"
            codes = [process.exitcode for process in self.ctx.processes]
            for rank, s in enumerate(self.model.status):
                assert s != "running"
                if s == "stopped":
                    assert codes[rank] == -15, f"rank {rank}: exit code {codes[rank]}"


def _comparable(outcome: tuple[str, Any]) -> tuple[str, Any]:
    kind, value = outcome
    return (kind, signature(value)) if kind == "raised" else outcome


async def run_example(nprocs: int, ops: Sequence[tuple[Any, ...]]) -> None:
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in range(nprocs)]
    readers = [reader for reader, _ in pipes]
    writers = [writer for _, writer in pipes]
    example: Example | None = None
    try:
        ctx = await aiospawn.start_processes(
            ranks.rel_obey, (readers,), nprocs, join=False, start_method="fork"
        )
        example = Example(ctx, Model(nprocs), writers)
        for op in ops:
            example.steps.append(repr(op))
            if op[0] == "command":
                await example.command(op[1], op[2])
            elif op[0] == "join":
                await example.join_twice(op[1])
            elif op[0] == "terminate":
                await example.terminate()
            elif op[0] == "cancel_join":
                await example.cancel_join()
            else:
                example.results()
            example.check_invariants()
        await ctx.terminate(grace_period=5)
        assert not live_children() & set(example.pids)
    finally:
        if example is not None:
            example.close()
        for reader, writer in pipes:
            reader.close()
            writer.close()


def run_in_loop(backend: str, nprocs: int, ops: Sequence[tuple[Any, ...]]) -> None:
    children, fds = live_children(), open_fds()
    anyio.run(run_example, nprocs, ops, backend=backend)
    gc.collect()
    assert live_children() <= children
    assert open_fds() <= fds


def example_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,  # nothing written into the working tree
        suppress_health_check=[HealthCheck.too_slow],
    )


@pytest.mark.parametrize("backend", BACKENDS)
@example_settings(15)
@given(nprocs=st.integers(1, 3), ops=operations)
def test_random_operations_keep_the_group_consistent(
    backend: str, nprocs: int, ops: list[tuple[Any, ...]]
) -> None:
    run_in_loop(backend, nprocs, ops)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@example_settings(max(1, int(100 * STRESS)))
@given(nprocs=st.integers(1, 3), ops=operations)
def test_random_operations_keep_the_group_consistent_many_times(
    backend: str, nprocs: int, ops: list[tuple[Any, ...]]
) -> None:
    run_in_loop(backend, nprocs, ops)
