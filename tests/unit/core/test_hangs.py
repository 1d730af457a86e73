"""Hang detection: the decisions, a pure function of the running ranks and the time;
and the monitor that acts on them, with the group played by the test."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

import anyio
import pytest

from aiospawn._core._backend import RankHandle
from aiospawn._core._concurrency import Broadcast
from aiospawn._core._hangs import (
    STACK_TIMEOUT,
    HangCheck,
    HangMonitor,
    HangWatch,
    Overdue,
    Watched,
)
from aiospawn._core._outcome import Hang
from tests.fake_backend import FakeClock
from tests.helpers import tripwire


def test_a_rank_that_never_beats_is_hung_after_the_startup_timeout() -> None:
    watch = HangWatch(heartbeat_timeout=10, startup_timeout=30)
    ranks = [Watched(rank=0, started=100.0, last_beat=None)]
    assert watch.find(ranks, now=120.0) == HangCheck(hung=(), next_check=10.0)
    assert watch.find(ranks, now=130.0) == HangCheck(
        hung=(Overdue(rank=0, seconds=30.0, began=False, limit=30),), next_check=math.inf
    )


def test_a_rank_that_stops_beating_is_hung_after_the_heartbeat_timeout() -> None:
    watch = HangWatch(heartbeat_timeout=10, startup_timeout=30)
    ranks = [
        Watched(rank=0, started=100.0, last_beat=125.0),
        Watched(rank=1, started=100.0, last_beat=128.0),
    ]
    check = watch.find(ranks, now=136.0)
    assert check.hung == (Overdue(rank=0, seconds=11.0, began=True, limit=10),)
    assert check.next_check == 2.0  # rank 1 could be hung at 138


def test_ranks_being_stopped_are_not_hung() -> None:
    watch = HangWatch(heartbeat_timeout=10, startup_timeout=None)
    ranks = [Watched(rank=0, started=0.0, last_beat=1.0, stopping=True)]
    assert watch.find(ranks, now=1000.0) == HangCheck(hung=(), next_check=math.inf)


def test_without_a_startup_timeout_a_silent_rank_is_looked_at_again() -> None:
    watch = HangWatch(heartbeat_timeout=10, startup_timeout=None)
    ranks = [Watched(rank=0, started=0.0, last_beat=None)]
    assert watch.find(ranks, now=1000.0) == HangCheck(hung=(), next_check=10.0)


def test_with_a_startup_timeout_alone_a_rank_that_beat_cannot_hang() -> None:
    watch = HangWatch(heartbeat_timeout=None, startup_timeout=5)
    ranks = [Watched(rank=0, started=0.0, last_beat=1.0)]
    assert watch.find(ranks, now=1000.0) == HangCheck(hung=(), next_check=math.inf)


def test_every_hung_rank_is_named_in_rank_order() -> None:
    watch = HangWatch(heartbeat_timeout=1, startup_timeout=1)
    ranks = [Watched(rank=index, started=0.0, last_beat=None) for index in range(3)]
    assert [overdue.rank for overdue in watch.find(ranks, now=5.0).hung] == [0, 1, 2]


class Attempt:
    """The little of a rank attempt the hang monitor reads: its beats and its stacks."""

    def __init__(self, rank: int, last_beat: float | None = None) -> None:
        self.rank = rank
        self.pid = 100 + rank
        self.beat = last_beat
        self.asked: list[float] = []  # the patience of each stack request

    def last_beat(self) -> float | None:
        return self.beat

    async def stack(self, patience: float) -> str:
        self.asked.append(patience)
        await anyio.lowlevel.checkpoint()
        return f"stack of rank {self.rank}"


class Group:
    """The group as the monitor sees it: the attempts that run, and what it was told."""

    def __init__(self, *attempts: Attempt, started: float = 100.0) -> None:
        self.attempts = list(attempts)
        self.started = started
        self.stopping: set[int] = set()  # found failed, or being stopped
        self.shutting_down = False
        self.looked = 0  # snapshots taken
        self.changed = Broadcast()
        self.reports: list[tuple[int, Hang]] = []

    def running(self) -> Iterator[tuple[RankHandle, float, bool]]:
        self.looked += 1
        for attempt in self.attempts:
            yield cast("RankHandle", attempt), self.started, attempt.rank in self.stopping

    def report(self, rank: RankHandle, hang: Hang) -> None:
        # As the group does: the rank is failed, and stopped; not hung again.
        self.reports.append((rank.rank, hang))
        self.stopping.add(rank.rank)
        self.changed.notify()

    def monitor(self, clock: FakeClock, heartbeat: float, startup: float) -> HangMonitor:
        watch = HangWatch(heartbeat_timeout=heartbeat, startup_timeout=startup)
        return HangMonitor(
            watch,
            clock=clock,
            changed=self.changed,
            running=self.running,
            shutting_down=lambda: self.shutting_down,
            report=self.report,
        )


async def run_until_blocked(monitor: HangMonitor, then: Any = None) -> None:
    """Run the monitor until it waits; ``then()`` (if given) and again; then stop it."""
    with tripwire(10, "the hang monitor"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor.run)
            await anyio.wait_all_tasks_blocked()
            if then is not None:
                then()
                await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_monitor_reports_a_hung_rank_once_with_its_stacks() -> None:
    clock = FakeClock(130.0)
    silent, beating = Attempt(0), Attempt(1, last_beat=125.0)
    group = Group(silent, beating)
    await run_until_blocked(group.monitor(clock, heartbeat=10, startup=30))
    expected = Hang(rank=0, pid=100, seconds=30.0, began=False, timeout=30, stack="stack of rank 0")
    assert group.reports == [(0, expected)]
    assert silent.asked == [STACK_TIMEOUT]
    assert beating.asked == []


@pytest.mark.anyio
async def test_the_monitor_looks_again_when_the_group_changes() -> None:
    clock = FakeClock(110.0)
    late = Attempt(0)
    group = Group(late)

    def time_passes() -> None:
        # Real time would wake it within the startup timeout; a change of the
        # group (a rank started again, say) wakes it at once.
        clock.advance(30)
        group.changed.notify()

    await run_until_blocked(group.monitor(clock, heartbeat=10, startup=30), then=time_passes)
    assert [rank for rank, _ in group.reports] == [0]


@pytest.mark.anyio
async def test_while_the_group_shuts_down_the_monitor_looks_at_nothing() -> None:
    clock = FakeClock(1000.0)
    group = Group(Attempt(0))
    group.shutting_down = True

    def shutdown_ends() -> None:
        group.shutting_down = False
        group.changed.notify()

    await run_until_blocked(group.monitor(clock, heartbeat=10, startup=30), then=None)
    assert (group.looked, group.reports) == (0, [])
    await run_until_blocked(group.monitor(clock, heartbeat=10, startup=30), then=shutdown_ends)
    assert [rank for rank, _ in group.reports] == [0]


class Exited(Attempt):
    """An attempt whose process has exited: it answers for no stack, at once."""

    async def stack(self, patience: float) -> None:  # type: ignore[override]
        self.asked.append(patience)


@pytest.mark.anyio
async def test_a_report_the_group_declines_is_not_probed_again() -> None:
    # The rank exited after the group's snapshot, before its exit was recorded:
    # the group declines the report. Probing it again at once, with no wait,
    # would spin the loop and starve the task that records the exit.
    clock = FakeClock(1000.0)
    gone = Exited(0)
    group = Group(gone)
    declined: list[int] = []
    group.report = lambda rank, hang: declined.append(rank.rank)  # type: ignore[method-assign]
    await run_until_blocked(group.monitor(clock, heartbeat=10, startup=30))
    assert (declined, gone.asked) == ([0], [STACK_TIMEOUT])
