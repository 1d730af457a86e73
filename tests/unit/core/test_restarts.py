"""Restarts: the decisions, pure functions of a policy, a snapshot of the group and the time;
and carrying them out, with the group's slots played by the test."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import cast

import anyio
import pytest

from aiospawn import Backoff, RestartPolicy
from aiospawn._core._backend import RankHandle
from aiospawn._core._concurrency import Broadcast
from aiospawn._core._events import EventLog, Restarting
from aiospawn._core._outcome import RankExit
from aiospawn._core._restarts import (
    HISTORY_TAIL,
    NOTE_RECORDS,
    GiveUp,
    GroupView,
    Restart,
    Restarts,
    RestartTracker,
    decide,
)
from tests.fake_backend import FakeClock
from tests.helpers import tripwire

FAST = Backoff(initial=0)


def view(
    nprocs: int = 3,
    running: tuple[int, ...] = (0, 1, 2),
    *,
    restarting: bool = False,
    shutting_down: bool = False,
) -> GroupView:
    return GroupView(
        nprocs=nprocs,
        running=frozenset(running),
        restarting=restarting,
        shutting_down=shutting_down,
    )


def failure(rank: int = 1, exit_code: int = 1) -> RankExit:
    return RankExit(rank=rank, pid=100 + rank, exit_code=exit_code, frame=None, stopped_by_us=False)


def test_without_a_policy_every_failure_is_the_root_cause() -> None:
    assert decide(None, 1, view(), [], now=0.0) == GiveUp(exceeded=False)


def test_no_restart_follows_a_shutdown() -> None:
    policy = RestartPolicy(backoff=FAST)
    assert decide(policy, 1, view(shutting_down=True), [], now=0.0) == GiveUp(exceeded=False)


def test_one_for_all_restarts_every_rank_after_stopping_the_running_ones() -> None:
    policy = RestartPolicy(backoff=FAST)
    decision = decide(policy, 1, view(running=(0, 2)), [], now=0.0)
    assert decision == Restart(slots=(0, 1, 2), stop=(0, 2), delay=0.0, attempt=1)


def test_a_failure_during_a_whole_group_restart_is_a_consequence() -> None:
    policy = RestartPolicy(backoff=FAST)
    assert decide(policy, 2, view(restarting=True), [], now=0.0) is None


def test_one_for_one_restarts_the_failed_rank_alone() -> None:
    policy = RestartPolicy(strategy="one_for_one", backoff=FAST)
    exited = decide(policy, 1, view(running=(0, 2)), [], now=0.0)
    assert exited == Restart(slots=(1,), stop=(), delay=0.0, attempt=1)
    # A hung rank still runs: it is stopped before it is started again.
    hung = decide(policy, 1, view(running=(0, 1, 2)), [], now=0.0)
    assert hung == Restart(slots=(1,), stop=(1,), delay=0.0, attempt=1)
    # Another rank's pending restart does not make this failure a consequence.
    assert isinstance(decide(policy, 0, view(restarting=True), [], now=0.0), Restart)


@pytest.mark.parametrize(
    ("times", "now", "expected"),
    [
        ([], 100.0, "restart"),
        ([50.0], 100.0, "restart"),
        ([50.0, 60.0], 100.0, "give up"),  # max_restarts=2 within the window already
        ([30.0, 60.0], 100.0, "restart"),  # 30.0 is 70 s old: out of the 60 s window
        ([40.0, 60.0], 100.0, "restart"),  # exactly one window old: out
    ],
)
def test_intensity_counts_the_restarts_inside_the_window(
    times: list[float], now: float, expected: str
) -> None:
    policy = RestartPolicy(max_restarts=2, window=60, backoff=FAST)
    decision = decide(policy, 0, view(), times, now)
    if expected == "give up":
        assert decision == GiveUp(exceeded=True)
    else:
        assert isinstance(decision, Restart)


def test_an_infinite_window_counts_every_restart_of_the_group_life() -> None:
    policy = RestartPolicy(max_restarts=2, window=math.inf, backoff=FAST)
    assert decide(policy, 0, view(), [0.0, 1.0], now=1e9) == GiveUp(exceeded=True)


def test_max_restarts_zero_never_restarts() -> None:
    policy = RestartPolicy(max_restarts=0, backoff=FAST)
    assert decide(policy, 0, view(), [], now=0.0) == GiveUp(exceeded=True)


def test_the_backoff_grows_with_the_restarts_inside_the_window() -> None:
    policy = RestartPolicy(max_restarts=10, window=60, backoff=Backoff(initial=1, factor=2, max=5))
    delays = []
    for recent in range(5):
        times = [float(moment) for moment in range(recent)]
        decision = decide(policy, 0, view(), times, now=10.0)
        assert isinstance(decision, Restart)
        assert decision.attempt == recent + 1
        delays.append(decision.delay)
    assert delays == [1, 2, 4, 5, 5]
    # Once the group has run quietly for a window, the delay falls back.
    decision = decide(policy, 0, view(), [0.0, 1.0, 2.0], now=100.0)
    assert isinstance(decision, Restart)
    assert decision.delay == 1


def test_the_tracker_gives_up_with_every_failure_of_the_window_in_its_history() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=2, window=60, backoff=FAST))
    decisions = [
        tracker.on_failure(failure(0), attempt, view(), now=float(attempt), wall_time=0.0)
        for attempt in range(3)
    ]
    assert [type(decision) for decision in decisions] == [Restart, Restart, GiveUp]
    assert tracker.gave_up
    assert [record.restart for record in tracker.history] == [0, 1, 2]
    note = tracker.give_up_note()
    assert note.startswith(
        "restart policy gave up: more than max_restarts=2 failures within 60 s;"
        " the failures, oldest first:"
    )
    assert len(note.splitlines()) == 4


def test_the_tracker_records_neither_consequences_nor_failures_without_a_policy() -> None:
    tracker = RestartTracker(RestartPolicy(backoff=FAST))
    assert tracker.on_failure(failure(), 0, view(restarting=True), 0.0, 0.0) is None
    untracked = RestartTracker(None)
    assert untracked.on_failure(failure(), 0, view(), 0.0, 0.0) == GiveUp(exceeded=False)
    assert tracker.history == untracked.history == ()


def test_the_history_of_a_group_restarted_forever_stays_bounded() -> None:
    # on="any" restarts a rank after every return: a group that runs for
    # days makes thousands of records; the window needs only the recent ones.
    policy = RestartPolicy(max_restarts=3, window=60, backoff=FAST, on="any")
    tracker = RestartTracker(policy)
    for attempt in range(5000):
        returned = failure(0, exit_code=0)
        decision = tracker.on_failure(returned, attempt, view(), now=100.0 * attempt, wall_time=0)
        assert isinstance(decision, Restart)
    assert len(tracker.history) == HISTORY_TAIL + 1
    assert tracker.history[-1].restart == 4999
    # Then failures in a burst: the give-up keeps every failure of the window.
    now = 100.0 * 5000
    for attempt in range(5000, 5004):
        decision = tracker.on_failure(failure(0), attempt, view(), now=now, wall_time=0)
    assert decision == GiveUp(exceeded=True)
    assert [record.restart for record in tracker.history[-4:]] == [5000, 5001, 5002, 5003]
    assert len(tracker.history) <= policy.max_restarts + 1 + HISTORY_TAIL
    note = tracker.give_up_note().splitlines()
    assert len(note) == NOTE_RECORDS + 1
    assert "the last 10 of 5004 failures, oldest first:" in note[0]
    assert note[-1].endswith("rank 0 (pid 100, restart 5003): exit code 1")


class Attempt:
    """The little of a rank attempt that carrying out a restart reads: its rank and pid."""

    def __init__(self, rank: int, restart: int = 0) -> None:
        self.rank = rank
        self.pid = 100 * (restart + 1) + rank


class Slots:
    """The group as :class:`Restarts` sees it; the test decides how stops and starts go."""

    def __init__(self, nprocs: int, policy: RestartPolicy, *, stops: bool = True) -> None:
        self.attempts = [Attempt(rank) for rank in range(nprocs)]
        self.numbers = [0] * nprocs
        self.stops = stops
        self.start_error: Exception | None = None
        self.stopped: list[list[int]] = []
        self.gave_up: list[tuple[int, Exception | None]] = []
        self.events = EventLog()
        self.changed = Broadcast()
        self.restarts = Restarts(
            RestartTracker(policy),
            clock=FakeClock(),
            changed=self.changed,
            events=self.events,
            stop=self.stop,
            start_again=self.start_again,
            give_up=lambda failure, error: self.gave_up.append((failure.rank, error)),
        )

    async def stop(self, ranks: Sequence[RankHandle]) -> bool:
        await anyio.lowlevel.checkpoint()
        self.stopped.append([rank.rank for rank in ranks])
        return self.stops

    async def start_again(self, slots: Sequence[int]) -> list[RankHandle]:
        await anyio.lowlevel.checkpoint()
        if self.start_error is not None:
            raise self.start_error
        for index in slots:
            self.numbers[index] += 1
            self.attempts[index] = Attempt(index, self.numbers[index])
        return [cast("RankHandle", self.attempts[index]) for index in slots]

    def fail(self, rank: int, running: tuple[int, ...]) -> bool:
        return self.restarts.on_failure(
            failure(rank),
            view(len(self.attempts), running, restarting=self.restarts.pending),
            cast("list[RankHandle]", self.attempts),
            self.numbers,
        )

    async def step(self) -> list[int]:
        with tripwire(10, "a restart step"):
            attempts = cast("list[RankHandle]", list(self.attempts))
            fresh = await self.restarts.step(attempts, list(self.numbers))
        return [rank.rank for rank in fresh]

    async def event_log(self) -> list[tuple[str, int, int | None]]:
        self.events.close()
        return [
            (type(event).__name__, event.rank, event.pid)
            async for event in self.events.follow()
            if isinstance(event, Restarting)
        ]


@pytest.mark.anyio
async def test_a_restart_without_a_window_says_none(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    group = Slots(2, RestartPolicy(backoff=FAST, window=math.inf))
    assert group.fail(1, running=(0,)) is True
    assert "(restart 1 of at most 3)" in caplog.text


@pytest.mark.anyio
async def test_a_whole_group_restart_stops_the_others_then_starts_every_slot_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    group = Slots(3, RestartPolicy(backoff=FAST))
    assert group.fail(1, running=(0, 2)) is True
    assert "restarting the group in 0 s (restart 1 of at most" in caplog.text
    assert "of at most 3 within 60 s)" in caplog.text
    # A failure of the others while it is under way is its consequence.
    assert group.fail(0, running=(2,)) is True
    assert group.restarts.tracker.pending_slots() == {0, 1, 2}
    assert await group.step() == []  # the first step stops the running ranks
    assert group.stopped == [[0, 2]]
    assert await group.step() == [0, 1, 2]  # then, its backoff over, starts them again
    assert not group.restarts.pending
    assert group.restarts.tracker.restarts == 1
    assert group.numbers == [1, 1, 1]
    # Announced for the attempts it replaced, before they were started again.
    assert await group.event_log() == [("Restarting", rank, 100 + rank) for rank in range(3)]
    assert group.gave_up == []


@pytest.mark.anyio
async def test_a_failure_past_the_policys_intensity_is_given_up_on() -> None:
    group = Slots(2, RestartPolicy(max_restarts=0, backoff=FAST))
    assert group.fail(1, running=(0,)) is False
    assert not group.restarts.pending


@pytest.mark.anyio
async def test_a_rank_that_cannot_be_stopped_cannot_be_replaced() -> None:
    group = Slots(2, RestartPolicy(backoff=FAST), stops=False)
    group.fail(1, running=(0,))
    assert await group.step() == []
    assert group.gave_up == [(1, None)]


@pytest.mark.anyio
async def test_a_start_that_fails_gives_up_with_its_error() -> None:
    group = Slots(2, RestartPolicy(strategy="one_for_one", backoff=FAST))
    group.start_error = OSError("no room")
    group.fail(1, running=(0,))
    assert await group.step() == []
    assert group.gave_up == [(1, group.start_error)]
    assert group.restarts.tracker.restarts == 0


@pytest.mark.anyio
async def test_a_restart_dropped_during_its_backoff_never_starts() -> None:
    group = Slots(2, RestartPolicy(strategy="one_for_one", backoff=Backoff(initial=60)))
    group.fail(1, running=(0,))
    with tripwire(10, "the backoff"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(group.step)
            await anyio.wait_all_tasks_blocked()  # in its backoff
            assert group.restarts.drop() == {1}  # terminate(), say
            group.changed.notify()
    assert not group.restarts.pending
    assert group.numbers == [0, 0]
    assert group.restarts.tracker.restarts == 0
