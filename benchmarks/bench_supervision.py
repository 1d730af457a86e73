"""Scenario ``supervision``: the cost of ``aiospawn.heartbeat()``, how fast a hung rank is
found, and how fast a failed rank is started again.

* heartbeat: a rank of a group with ``heartbeat_timeout`` times N calls of
  ``aiospawn.heartbeat()`` (and the same loop with nothing in it); the parent
  times the same calls outside any group, where the function does nothing.
* hang: 2 fork ranks, ``heartbeat_timeout=1``, ``grace_period=0.2``. Rank 0
  sleeps and never beats; rank 1 beats, stores the ``time.monotonic()`` of its
  last beat in a shared ``multiprocessing.Value``, then hangs (a Python busy
  loop, or ``time.sleep``). From that stamp to the ``Hung`` event reaching a
  consumer of ``ctx.events()``, and to ``join()`` raising
  ``ProcessHungException``.
* restart: 2 fork ranks, ``Backoff(initial=0)``. Rank 1 stores
  ``time.monotonic()`` and calls ``os._exit(1)`` in its first run; from that
  stamp to the ``Started`` event of its second run reaching a consumer.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from functools import partial
from typing import Any, Literal

import anyio
from harness import Measure, Peer, ScenarioResult, alternate, ms, percentile

import aiospawn

# --- heartbeat cost ------------------------------------------------------------------------


def _time_calls(calls: int) -> tuple[float, float]:
    """Nanoseconds per ``aiospawn.heartbeat()`` call, and per pass of an empty loop."""
    beat = aiospawn.heartbeat
    started = time.perf_counter_ns()
    for _ in range(calls):
        beat()
    beating = time.perf_counter_ns() - started
    started = time.perf_counter_ns()
    for _ in range(calls):
        pass
    empty = time.perf_counter_ns() - started
    return beating / calls, empty / calls


def heartbeat_rank(rank: int, calls: int) -> tuple[float, float]:
    """Rank: time ``calls`` heartbeats (the group watches them)."""
    aiospawn.heartbeat()  # the rank is beating from here on, as a training loop would be
    return _time_calls(calls)


async def _heartbeat_in_rank(calls: int) -> Measure:
    results = await aiospawn.start_processes(
        heartbeat_rank, (calls,), nprocs=1, start_method="fork", heartbeat_timeout=30.0
    )
    beating, empty = results[0]
    return {"heartbeat() [ns/call]": beating, "empty loop [ns/pass]": empty}


def _heartbeat_outside(calls: int) -> Measure:
    beating, empty = _time_calls(calls)
    return {"heartbeat() [ns/call]": beating, "empty loop [ns/pass]": empty}


# --- hang detection ------------------------------------------------------------------------

HEARTBEAT_TIMEOUT = 1.0
HANG_GRACE = 0.2


def wait_for_peer_that_never_comes(how: str) -> None:
    """Hang as a rank stuck in a Python loop or in a blocking call does."""
    if how == "busy":
        while True:
            pass
    while True:
        time.sleep(3600)


def hang_rank(rank: int, last_beat: Any, how: str, beating: float) -> None:
    """Rank 1 beats for ``beating`` seconds, stamps its last beat, then hangs."""
    if rank != 1:
        while True:
            time.sleep(3600)
    deadline = time.monotonic() + beating
    while time.monotonic() < deadline:
        aiospawn.heartbeat()
        time.sleep(0.01)
    aiospawn.heartbeat()
    last_beat.value = time.monotonic()
    wait_for_peer_that_never_comes(how)


async def _hang(how: str) -> Measure:
    last_beat = multiprocessing.get_context("fork").Value("d", 0.0, lock=False)
    # A random phase, so that nothing lines up with the supervisor's timer.
    args = (last_beat, how, 0.1 + random.uniform(0.0, 0.1))
    ctx = await aiospawn.start_processes(
        hang_rank,
        args,
        nprocs=2,
        join=False,
        start_method="fork",
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        grace_period=HANG_GRACE,
    )
    hung_at: list[float] = []
    stacks: list[str | None] = []

    async def watch_events() -> None:
        async for event in ctx.events():
            if isinstance(event, aiospawn.Hung):
                hung_at.append(time.monotonic())
                stacks.append(event.stack)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_events)
        try:
            await ctx.join()
        except aiospawn.ProcessHungException as exc:
            raised = time.monotonic()
            hung_rank = exc.error_index
        else:
            raise AssertionError("join() returned although rank 1 hung")
    assert hung_rank == 1, f"rank {hung_rank} was found hung, not rank 1"
    assert hung_at, "no Hung event"
    assert "wait_for_peer_that_never_comes" in (stacks[0] or ""), stacks[0]
    return {
        "to Hung event [ms]": ms(hung_at[0] - last_beat.value),
        "to join() raising [ms]": ms(raised - last_beat.value),
    }


# --- restart latency -----------------------------------------------------------------------


def restart_rank(rank: int, failed_at: Any, done: Any) -> None:
    """Rank 1 fails in its first run; its second run releases rank 0 (one_for_one).

    ``done`` is a plain shared flag, polled: a ``multiprocessing.Event`` breaks
    for good when one_for_all kills rank 0 inside ``Event.wait()``.
    """
    if aiospawn.restart_count() > 0:
        if rank == 1:
            done.value = 1
        return
    if rank == 1:
        time.sleep(random.uniform(0.05, 0.15))
        failed_at.value = time.monotonic()
        os._exit(1)
    while not done.value:
        time.sleep(0.01)


async def _restart(strategy: Literal["one_for_all", "one_for_one"]) -> Measure:
    context = multiprocessing.get_context("fork")
    failed_at = context.Value("d", 0.0, lock=False)
    done = context.Value("i", 0, lock=False)
    policy = aiospawn.RestartPolicy(
        max_restarts=1,
        window=60,
        backoff=aiospawn.Backoff(initial=0),
        strategy=strategy,
    )
    ctx = await aiospawn.start_processes(
        restart_rank,
        (failed_at, done),
        nprocs=2,
        join=False,
        start_method="fork",
        restart=policy,
        grace_period=HANG_GRACE,
    )
    started_at: list[float] = []

    async def watch_events() -> None:
        async for event in ctx.events():
            if isinstance(event, aiospawn.Started) and event.rank == 1 and event.restart == 1:
                started_at.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_events)
        await ctx.join()
    assert started_at, "no Started event for rank 1's second run"
    return {"failure to Started [ms]": ms(started_at[0] - failed_at.value)}


# --- the scenario --------------------------------------------------------------------------


async def supervision(result: ScenarioResult, quick: bool) -> None:
    """Heartbeat cost, hang detection latency, restart latency."""
    calls = 1_000_000
    runs = 3 if quick else 7
    await alternate(
        result,
        f"heartbeat, {calls:,} calls",
        [
            Peer("in a rank (heartbeat_timeout)", partial(_heartbeat_in_rank, calls), runs),
            Peer("outside a group (no-op)", partial(_heartbeat_outside, calls), runs),
        ],
    )
    trials = 4 if quick else 10
    await alternate(
        result,
        f"hang, heartbeat_timeout={HEARTBEAT_TIMEOUT:g}",
        [
            Peer("Python busy loop", partial(_hang, "busy"), trials),
            Peer("time.sleep", partial(_hang, "sleep"), trials),
        ],
    )
    await alternate(
        result,
        "restart, Backoff(initial=0), 2 ranks",
        [
            Peer("one_for_all", partial(_restart, "one_for_all"), trials),
            Peer("one_for_one", partial(_restart, "one_for_one"), trials),
        ],
    )
    for series in result.series:
        result.note(
            f"{series.case} | {series.metric} | {series.peer}: max {max(series.samples):.4g},"
            f" min {min(series.samples):.4g}, median {percentile(series.samples, 50):.4g}"
        )
    result.note(
        "Every group uses the fork start method. heartbeat(): the loop calls a local alias of"
        " aiospawn.heartbeat, so the figure includes one pass of a Python for loop (the"
        " 'empty loop' row)."
    )
    result.note(
        f"hang: the timeout is {HEARTBEAT_TIMEOUT:g} s, so about {ms(HEARTBEAT_TIMEOUT):.0f} ms"
        " of each figure is the timeout itself. Both figures include taking the rank's stacks"
        " (faulthandler on a real-time signal; each trial checks the stack names the hanging"
        " function). join() also includes the group's shutdown with"
        f" grace_period={HANG_GRACE:g} s: rank 0 (sleeping) first gets {HANG_GRACE:g} s to exit"
        " by itself, then SIGTERM."
    )
    result.note(
        "restart: one_for_all first stops rank 0 (SIGTERM; it exits at once), then starts both"
        " ranks; one_for_one starts rank 1 alone."
    )
