"""Restart decisions, as pure functions of a policy, a snapshot of the group and the time."""

from __future__ import annotations

import math

import pytest

from aiospawn import Backoff, RestartPolicy
from aiospawn._core._outcome import RankExit
from aiospawn._core._restarts import (
    HISTORY_TAIL,
    NOTE_RECORDS,
    GiveUp,
    GroupView,
    Restart,
    RestartTracker,
    decide,
)

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
