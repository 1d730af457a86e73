"""Hang detection: which running ranks overran their heartbeat or startup timeout.

:meth:`HangWatch.find` is a pure function of a snapshot of the ranks
(:class:`Watched`) and ``now``: it names the ranks that are hung, or says how
long until one could be. :class:`HangMonitor` acts on it, as a task of the
group's owner: it takes the snapshot, sleeps until the next check (or until
the group changes), and, for a hung rank, takes its stacks and reports the
:class:`~aiospawn._core._outcome.Hang` to the group (``_group``), which fails
the rank.

Loaded only by the groups that watch heartbeats.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import anyio

from ._backend import HasHeartbeats, HasStacks, RankHandle
from ._concurrency import Broadcast, run_to_completion
from ._outcome import Hang

#: Seconds a hung rank gets to write its stacks before it is stopped anyway.
STACK_TIMEOUT = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Watched:
    """One running rank, as hang detection sees it.

    Attributes:
        rank: The rank.
        started: When its current attempt started, on the group's clock.
        last_beat: When it last called ``heartbeat()``, or None if it has not.
        stopping: We are stopping it (shutdown, a pending restart), or it was
            found failed already (hung, or it broke its channel): it is not
            (again) a hang.
    """

    rank: int
    started: float
    last_beat: float | None
    stopping: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Overdue:
    """A rank found hung.

    Attributes:
        rank: The rank.
        seconds: Since its last heartbeat, or since its start if it never beat.
        began: It had sent a first heartbeat (the limit is ``heartbeat_timeout``).
        limit: The timeout it overran.
    """

    rank: int
    seconds: float
    began: bool
    limit: float


@dataclass(frozen=True, slots=True, kw_only=True)
class HangCheck:
    """What one look at the ranks found.

    Attributes:
        hung: The ranks found hung, in the snapshot's order.
        next_check: Seconds until another rank could be hung (``math.inf``:
            none can be until the group changes).
    """

    hung: tuple[Overdue, ...]
    next_check: float


@dataclass(frozen=True, slots=True, kw_only=True)
class HangWatch:
    """The timeouts of a group that watches heartbeats.

    Attributes:
        heartbeat_timeout: Seconds a rank may go between heartbeats, once it
            has sent one; None: no limit.
        startup_timeout: Seconds a rank may take to send its first; None: no limit.
    """

    heartbeat_timeout: float | None
    startup_timeout: float | None

    def find(self, ranks: Sequence[Watched], now: float) -> HangCheck:
        """Find the ranks of ``ranks`` that are hung at ``now``; pure."""
        hung = []
        next_check = math.inf
        for rank in ranks:
            if rank.stopping:
                continue
            began = rank.last_beat is not None
            limit = self.heartbeat_timeout if began else self.startup_timeout
            if limit is None:
                if not began and self.heartbeat_timeout is not None:
                    # No startup_timeout, and nothing tells us of a first
                    # beat: look again within the heartbeat timeout.
                    next_check = min(next_check, self.heartbeat_timeout)
                # Else it beat, and only its startup is timed: it cannot hang.
                continue
            since = rank.last_beat if rank.last_beat is not None else rank.started
            if now - since >= limit:
                hung.append(Overdue(rank=rank.rank, seconds=now - since, began=began, limit=limit))
            else:
                next_check = min(next_check, since + limit - now)
        return HangCheck(hung=tuple(hung), next_check=max(0.0, next_check))


class HangMonitor:
    """Finds a group's hung ranks and reports them; the group's owner runs :meth:`run`.

    One concern: hangs. It reads the group through the callables it is given
    (the attempts that run, whether the group is shutting down) and wakes when
    the group changes (ranks started again, stopped); what a hang does to the
    group is the group's (``report``).
    """

    def __init__(
        self,
        watch: HangWatch,
        *,
        clock: Callable[[], float],
        changed: Broadcast,
        running: Callable[[], Iterable[tuple[RankHandle, float, bool]]],
        shutting_down: Callable[[], bool],
        report: Callable[[RankHandle, Hang], None],
    ) -> None:
        """Watch with ``watch``'s timeouts.

        Args:
            watch: The timeouts.
            clock: The group's monotonic clock (the one heartbeats are timed on).
            changed: Notified whenever the group changes.
            running: The current attempts that run, each with when it started
                (on ``clock``) and whether the group stops it or has found it failed.
            shutting_down: True once the group's shutdown has begun: every
                rank is being stopped anyway.
            report: Called with a rank found hung and its hang, stacks taken.
        """
        self._watch = watch
        self._clock = clock
        self._changed = changed
        self._running = running
        self._shutting_down = shutting_down
        self._report = report

    async def run(self) -> None:
        """Find ranks that stopped beating (or never began), and report them; until cancelled."""
        # Each attempt is probed once at most: the group may decline a report
        # (the rank exited meanwhile), and probing it again at once would spin
        # the loop without ever letting that exit be recorded.
        probed: weakref.WeakSet[RankHandle] = weakref.WeakSet()
        while True:
            if self._shutting_down():
                await self._changed.wait()
                continue
            attempts: dict[int, RankHandle] = {}
            watched = []
            for rank, started, stopping in self._running():
                attempts[rank.rank] = rank
                last_beat = rank.last_beat() if isinstance(rank, HasHeartbeats) else None
                watched.append(
                    Watched(
                        rank=rank.rank,
                        started=started,
                        last_beat=last_beat,
                        stopping=stopping or rank in probed,
                    )
                )
            check = self._watch.find(watched, self._clock())
            if not check.hung:
                with anyio.move_on_after(check.next_check):  # or sooner: ranks (re)started
                    await self._changed.wait()
                continue
            # To the end, even if the owner is cancelled meanwhile: the stack
            # is taken once, and the hang reported. (Nothing looks for hangs
            # meanwhile, so the rank is not found hung twice.)
            overdue = check.hung[0]
            probed.add(attempts[overdue.rank])
            await run_to_completion(functools.partial(self._probe, attempts[overdue.rank], overdue))

    async def _probe(self, rank: RankHandle, overdue: Overdue) -> None:
        pid = rank.pid
        assert pid is not None
        stack = await rank.stack(STACK_TIMEOUT) if isinstance(rank, HasStacks) else None
        hang = Hang(
            rank=rank.rank,
            pid=pid,
            seconds=overdue.seconds,
            began=overdue.began,
            timeout=overdue.limit,
            stack=stack,
        )
        self._report(rank, hang)
