"""Restart decisions: the intensity window, the backoff, the history of failures.

A failure the group's supervisor sees (an exit it did not cause, or a hang)
goes to :meth:`RestartTracker.on_failure`, which answers with a
:class:`Restart` (what to stop, what to start again, after how long), a
:class:`GiveUp` (the failure is the group's root cause), or ``None`` (a
consequence of a whole-group restart already under way: not a cause). The
answer is :func:`decide`, a pure function of the policy, a :class:`GroupView`
snapshot, the times of recent restarts and ``now``; the tracker only keeps
those times and the history.

:class:`Restarts` carries the decisions out for the group's owner: it queues
a restart, and then, one step per call, stops the ranks it stops, backs off,
and starts the slots again. What that does to the group's slots (which
attempt holds each, how one is stopped or started) is the group's
(``_group``), asked for through the callables it passes.

What is kept stays bounded however long a group runs: the times of the
restarts inside the window (at most ``max_restarts``) and the failures inside
the window plus the :data:`HISTORY_TAIL` before them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio

from ._backend import RankHandle
from ._concurrency import Broadcast, run_to_completion
from ._events import EventLog, Restarting
from ._log import logger
from ._outcome import Failure, RankExit
from ._policy import RestartPolicy, RestartRecord

#: Failures kept beyond those inside the restart window, for the report.
HISTORY_TAIL = 20

#: Failures the give-up note lists at the most (the newest ones).
NOTE_RECORDS = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupView:
    """What a restart decision reads of a group, at one moment.

    Attributes:
        nprocs: How many ranks the group has.
        running: The ranks whose current attempt runs (started, not exited).
        restarting: A restart is pending (decided, not yet started).
        shutting_down: The group's shutdown has begun.
    """

    nprocs: int
    running: frozenset[int]
    restarting: bool
    shutting_down: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """Start ``slots`` again after ``delay`` seconds, once ``stop`` have been stopped.

    Attributes:
        slots: The ranks to start again.
        stop: The running ranks to stop first (for ``one_for_all``, all of them).
        delay: The backoff, in seconds.
        attempt: This restart's number within the window (1: the first).
    """

    slots: tuple[int, ...]
    stop: tuple[int, ...]
    delay: float
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GiveUp:
    """No restart: the failure is the group's root cause.

    Attributes:
        exceeded: The policy's intensity was exceeded (else there is no
            policy, or the group is shutting down, when no restart can follow).
    """

    exceeded: bool


def decide(
    policy: RestartPolicy | None,
    rank: int,
    view: GroupView,
    restart_times: Sequence[float],
    now: float,
) -> Restart | GiveUp | None:
    """Decide what follows a failure of ``rank``; pure.

    Args:
        policy: The group's restart policy, if any.
        rank: The rank that failed.
        view: The group at the time of the failure.
        restart_times: When the earlier restarts were decided, on the clock
            of ``now``.
        now: The time of the failure.

    Returns:
        A :class:`Restart`, a :class:`GiveUp`, or ``None`` when the failure is
        a consequence of a whole-group restart under way (ranks stopped by it,
        or failing because their peers went).
    """
    if policy is None or view.shutting_down:
        # A failure found while the group shuts down still caused it; no
        # restart can follow a shutdown.
        return GiveUp(exceeded=False)
    if policy.strategy == "one_for_all" and view.restarting:
        return None
    recent = sum(1 for moment in restart_times if now - moment < policy.window)
    if recent >= policy.max_restarts:
        return GiveUp(exceeded=True)
    if policy.strategy == "one_for_all":
        slots = tuple(range(view.nprocs))
        stop = tuple(sorted(view.running))
    else:
        slots = (rank,)
        stop = (rank,) if rank in view.running else ()
    return Restart(slots=slots, stop=stop, delay=policy.backoff.delay(recent), attempt=recent + 1)


@dataclass(slots=True)
class PendingRestart:
    """Slots to start again once ``due`` (on the group's clock) has come.

    ``stop`` lists the running attempts to stop first; ``failure`` is what the
    restart answers, raised if the restart cannot happen.
    """

    slots: list[int]
    due: float
    stop: list[RankHandle]
    failure: Failure
    announced: bool = False


@dataclass(slots=True)
class RestartTracker:
    """A group's restart state: the window's restarts, the history, the pending restarts.

    Attributes:
        policy: The group's restart policy, if any.
        pending: The restarts decided and not yet started, oldest first.
        gave_up: The policy's intensity was exceeded.
        restarts: Restarts carried out so far, over all ranks.
    """

    policy: RestartPolicy | None
    pending: list[PendingRestart] = field(default_factory=list)
    gave_up: bool = False
    restarts: int = 0
    _times: list[float] = field(default_factory=list)
    _history: deque[tuple[float, RestartRecord]] = field(default_factory=deque)
    _failures: int = 0

    def on_failure(
        self, failure: Failure, attempt: int, view: GroupView, now: float, wall_time: float
    ) -> Restart | GiveUp | None:
        """Decide (see :func:`decide`) and record what follows ``failure``.

        Args:
            failure: The failure.
            attempt: The failed rank's restart count (0: its first run).
            view: The group at the time of the failure.
            now: The time of the failure, on the group's monotonic clock.
            wall_time: The same, as ``time.time()``, for the history.
        """
        decision = decide(self.policy, failure.rank, view, self._times, now)
        if decision is None or (isinstance(decision, GiveUp) and not decision.exceeded):
            return decision
        assert self.policy is not None
        self._record(failure, attempt, now, wall_time)
        if isinstance(decision, GiveUp):
            self.gave_up = True
        else:
            self._times = [
                *(moment for moment in self._times if now - moment < self.policy.window),
                now,
            ]
        return decision

    def pending_slots(self) -> set[int]:
        """The slots waiting for a restart."""
        return {index for pending in self.pending for index in pending.slots}

    @property
    def history(self) -> tuple[RestartRecord, ...]:
        """The failures acted on that are kept, oldest first."""
        return tuple(record for _, record in self._history)

    def give_up_note(self) -> str:
        """The note a give-up adds to the root cause's exception: short, newest last."""
        policy = self.policy
        assert policy is not None
        shown = self.history[-NOTE_RECORDS:]
        which = (
            "the failures"
            if len(shown) == self._failures
            else f"the last {len(shown)} of {self._failures} failures"
        )
        lines = "\n".join(f"    {record}" for record in shown)
        return (
            f"restart policy gave up: more than max_restarts={policy.max_restarts}"
            f" failures within {policy.window:g} s; {which}, oldest first:\n{lines}"
        )

    def _record(self, failure: Failure, attempt: int, now: float, wall_time: float) -> None:
        assert self.policy is not None
        record = RestartRecord(
            rank=failure.rank,
            pid=failure.pid,
            restart=attempt,
            outcome=failure.summary(),
            exit_code=failure.exit_code if isinstance(failure, RankExit) else None,
            time=wall_time,
        )
        self._failures += 1
        self._history.append((now, record))
        # Keep the failures inside the window (they explain a give-up) and a
        # bounded tail before them: a group restarted on every return
        # (on="any") would otherwise grow its history for its whole life.
        inside = sum(1 for moment, _ in self._history if now - moment < self.policy.window)
        for _ in range(len(self._history) - inside - HISTORY_TAIL):
            self._history.popleft()


class Restarts:
    """Carries out a group's restarts: from a failure the policy absorbs to the fresh attempts.

    One concern: restarts. :meth:`on_failure` asks the tracker what follows a
    failure and queues the restart it decides; while one is pending, the
    group's owner calls :meth:`step`. The group's slots are read from the
    snapshots each call is given (the current attempt at each slot, and its
    number) and changed only through the callables passed here.
    """

    def __init__(
        self,
        tracker: RestartTracker,
        *,
        clock: Callable[[], float],
        changed: Broadcast,
        events: EventLog,
        stop: Callable[[Sequence[RankHandle]], Awaitable[bool]],
        start_again: Callable[[Sequence[int]], Awaitable[list[RankHandle]]],
        give_up: Callable[[Failure, Exception | None], None],
    ) -> None:
        """Carry out the decisions of ``tracker``.

        Args:
            tracker: The group's restart state, which the group reads too.
            clock: The group's monotonic clock (backoffs are timed on it).
            changed: Notified whenever the group changes.
            events: The group's event log, for the ``Restarting`` events.
            stop: Stops running attempts, to the end; False if one of them
                cannot be reaped (then it cannot be replaced either).
            start_again: Makes and starts the next attempt at each of the
                slots; raises what their start raised.
            give_up: Called when a restart cannot happen, with the failure it
                answered and the error that stopped it (None: a rank that
                could not be reaped).
        """
        self.tracker = tracker
        self._clock = clock
        self._changed = changed
        self._events = events
        self._stop = stop
        self._start_again = start_again
        self._give_up = give_up

    @property
    def pending(self) -> bool:
        """True while a restart is decided and not yet started."""
        return bool(self.tracker.pending)

    def on_failure(
        self,
        failure: Failure,
        view: GroupView,
        attempts: Sequence[RankHandle],
        numbers: Sequence[int],
    ) -> bool:
        """Decide what follows ``failure``, and queue the restart if there is one.

        Args:
            failure: A failure the group did not cause.
            view: The group now.
            attempts: The current attempt at each slot.
            numbers: Each current attempt's number (0: the slot's first).

        Returns:
            False if the policy gives up (``failure`` is the group's root
            cause); True if a restart answers it, or a whole-group restart
            under way explains it.
        """
        now = self._clock()
        decision = self.tracker.on_failure(failure, numbers[failure.rank], view, now, time.time())
        if decision is None:
            return True  # the group is being restarted: a consequence, not a cause
        if isinstance(decision, GiveUp):
            return False
        policy = self.tracker.policy
        assert policy is not None
        stop = [attempts[index] for index in decision.stop]
        self.tracker.pending.append(
            PendingRestart(list(decision.slots), now + decision.delay, stop, failure)
        )
        within = "" if math.isinf(policy.window) else f" within {policy.window:g} s"
        logger.warning(
            "Rank %d (pid %d) failed (%s); restarting %s in %.3g s (restart %d of at most %d%s)"
            "\n%s",
            failure.rank,
            failure.pid,
            failure.summary(),
            "the group" if policy.strategy == "one_for_all" else "it",
            decision.delay,
            decision.attempt,
            policy.max_restarts,
            within,
            str(failure.exception()).strip("\n"),
        )
        return True

    def drop(self) -> set[int]:
        """Cancel the pending restarts; returns the slots that waited for one."""
        slots = self.tracker.pending_slots()
        self.tracker.pending.clear()
        return slots

    async def step(
        self, attempts: Sequence[RankHandle], numbers: Sequence[int]
    ) -> list[RankHandle]:
        """Make progress on the pending restarts: stop, back off, or start again.

        Returns after each step, or when something changed, so that the
        owner looks at the group afresh (a new failure, a shutdown).

        Args:
            attempts: The current attempt at each slot.
            numbers: Each current attempt's number.

        Returns:
            The attempts this step started, for the owner to watch (empty if
            it started none).
        """
        pending = self.tracker.pending
        stop = [rank for restart in pending for rank in restart.stop]
        if stop:
            failure = pending[0].failure
            for restart in pending:
                restart.stop = []
            if not await self._stop(stop):
                self._give_up(failure, None)
            return []
        now = self._clock()
        for restart in pending:
            if not restart.announced:
                restart.announced = True
                for index in restart.slots:
                    self._events.append(
                        Restarting(
                            rank=index,
                            pid=attempts[index].pid,
                            attempt=numbers[index] + 1,
                            delay=max(0.0, restart.due - now),
                        )
                    )
        first = min(pending, key=lambda restart: restart.due)
        with anyio.move_on_after(first.due - now):
            await self._changed.wait()
            return []
        if first not in pending:
            # Dropped meanwhile: terminate(), or a failure the policy gave up
            # on (the group drops its pending restarts as it finishes).
            return []

        async def start_again() -> list[RankHandle]:
            # Removed only here: under asyncio, run_to_completion starts this in
            # a task of its own, and until then the group must not read as over
            # (wait_ready() would return with the old attempt's slot empty).
            if first not in pending:
                return []  # dropped meanwhile (terminate())
            pending.remove(first)
            return await self._start_again(first.slots)

        # Started to the end, whatever is asked meanwhile: a slot left with an
        # attempt that never started would read as finished.
        try:
            fresh = await run_to_completion(start_again)
        except Exception as exc:
            self._give_up(first.failure, exc)
            return []
        if fresh:
            self.tracker.restarts += 1
        return fresh
