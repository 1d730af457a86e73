"""Hang detection: which running ranks overran their heartbeat or startup timeout.

:meth:`HangWatch.find` is a pure function of a snapshot of the ranks
(:class:`Watched`) and ``now``: it names the ranks that are hung, or says how
long until one could be. The supervisor (``_group``) takes the snapshot,
sleeps until the next check (or until the group changes), and, for a hung
rank, takes its stacks and reports the :class:`~aiospawn._core._outcome.Hang`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Watched:
    """One running rank, as hang detection sees it.

    Attributes:
        rank: The rank.
        started: When its current attempt started, on the group's clock.
        last_beat: When it last called ``heartbeat()``, or None if it has not.
        stopping: We are stopping it (shutdown, a pending restart), or it was
            found hung already, or its stacks are being taken: it is not
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
