"""Lifecycle events of a group, and the log that hands them to every consumer.

Supervision appends an immutable record for each thing that happens to a
rank; each ``ctx.events()`` iterator reads the one log at its own pace. The
log holds the newest :data:`EVENT_BUFFER` records: appending never waits, so
a slow consumer cannot hold supervision back. A consumer that falls further
behind than that first receives an :class:`EventsLost` saying how many it
missed, then goes on from the oldest record still held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from time import monotonic
from time import time as wall_clock

from ._concurrency import Broadcast

__all__ = [
    "EVENT_BUFFER",
    "Event",
    "EventLog",
    "EventsLost",
    "Exited",
    "GroupStatistics",
    "Hung",
    "RankEvent",
    "RankStatistics",
    "Ready",
    "Restarting",
    "Started",
    "Stopped",
    "Terminating",
]

#: How many records the log holds for consumers that lag behind.
EVENT_BUFFER = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Something that happened to a group.

    Attributes:
        time: When, on the ``time.monotonic()`` clock.
        wall_time: When, as ``time.time()``.
    """

    time: float = field(default_factory=monotonic)
    wall_time: float = field(default_factory=wall_clock)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEvent(Event):
    """Something that happened to one rank.

    Attributes:
        rank: The rank.
        pid: The process id of the rank's current (or last) process.
    """

    rank: int
    pid: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Started(RankEvent):
    """The rank's process started. ``restart`` counts its earlier runs."""

    restart: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(RankEvent):
    """The rank called ``aiospawn.ready()``: it is ready to serve (see ``ctx.wait_ready()``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Exited(RankEvent):
    """The rank's process ended and was reaped.

    Attributes:
        exit_code: As ``multiprocessing`` reports it: negative for a signal.
        signal_name: The signal that ended it (``"SIGTERM"``), else ``None``.
        outcome: ``"returned"``, ``"raised"``, ``"exit code 3"``, ``"SIGKILL"``.
        stopped_by_us: True when aiospawn had asked it to stop.
    """

    exit_code: int
    signal_name: str | None
    outcome: str
    stopped_by_us: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Hung(RankEvent):
    """The rank stopped sending heartbeats (or never began) and will be stopped.

    Attributes:
        seconds: Since its last heartbeat, or since it started.
        stack: Its threads' stacks, or ``None`` if it did not answer.
    """

    seconds: float
    stack: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Restarting(RankEvent):
    """The rank will be started again after ``delay`` seconds, for the ``attempt``-th time."""

    attempt: int
    delay: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Terminating(RankEvent):
    """aiospawn sent the rank ``signal_name`` (``"SIGTERM"``, then ``"SIGKILL"``)."""

    signal_name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopped(RankEvent):
    """The rank is finished for good: it will not be started again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsLost(Event):
    """This consumer fell behind and missed ``count`` events."""

    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStatistics:
    """One rank in a :class:`GroupStatistics` snapshot.

    Attributes:
        rank: The rank.
        pid: Its current (or last) process id, once started.
        state: ``"starting"``, ``"running"``, ``"stopping"`` (asked to stop),
            ``"restarting"`` (waiting to be started again) or ``"exited"``.
        restarts: How many times it has been restarted.
        last_start: Its latest start, once started.
        last_exit: Its latest exit, if it has exited.
        ready: True once its current attempt has called ``aiospawn.ready()``
            (seen by the supervisor: while ``wait_ready()``, ``receive()``,
            ``call()`` or the group's supervision reads its channel).
    """

    rank: int
    pid: int | None
    state: str
    restarts: int
    last_start: Started | None
    last_exit: Exited | None
    ready: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupStatistics:
    """A snapshot of a group, from ``ctx.statistics()``.

    Attributes:
        alive: Ranks whose process runs now.
        restarts: Restarts so far, over all ranks.
        ranks: One :class:`RankStatistics` per rank, index = rank.
    """

    alive: int
    restarts: int
    ranks: tuple[RankStatistics, ...]


class EventLog:
    """The newest ``size`` events of a group, read by any number of consumers."""

    def __init__(self, size: int = EVENT_BUFFER) -> None:
        self._events: deque[Event] = deque(maxlen=size)
        self._appended = 0  # sequence number of the next event
        self._closed = False
        self._new = Broadcast()

    def append(self, event: Event) -> None:
        """Add an event; never waits."""
        self._events.append(event)
        self._appended += 1
        self._new.notify()

    def close(self) -> None:
        """No more events will come: consumers finish once they have read the rest."""
        self._closed = True
        self._new.notify()

    async def follow(self) -> AsyncGenerator[Event, None]:
        """Yield every event from the group's first, then each one as it comes."""
        position = 0
        while True:
            oldest = self._appended - len(self._events)
            if position < oldest:
                yield EventsLost(count=oldest - position)
                position = oldest
            if position < self._appended:
                event = self._events[position - oldest]
                position += 1
                yield event
            elif self._closed:
                return
            else:
                await self._new.wait()
