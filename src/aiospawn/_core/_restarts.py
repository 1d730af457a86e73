"""Restart decisions: the intensity window, the backoff, the history of failures.

A failure the group's supervisor sees (an exit it did not cause, or a hang)
goes to :meth:`RestartTracker.on_failure`, which answers with a
:class:`Restart` (what to stop, what to start again, after how long), a
:class:`GiveUp` (the failure is the group's root cause), or ``None`` (a
consequence of a whole-group restart already under way: not a cause). The
answer is :func:`decide`, a pure function of the policy, a :class:`GroupView`
snapshot, the times of recent restarts and ``now``; the tracker only keeps
those times and the history. Carrying a restart out (stop, back off, start
again) is the supervisor's part (``_group``).

What is kept stays bounded however long a group runs: the times of the
restarts inside the window (at most ``max_restarts``) and the failures inside
the window plus the :data:`HISTORY_TAIL` before them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._backend import RankHandle
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
