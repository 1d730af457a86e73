"""Hang detection decisions, as a pure function of the running ranks and the time."""

from __future__ import annotations

import math

from aiospawn._core._hangs import HangCheck, HangWatch, Overdue, Watched


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
