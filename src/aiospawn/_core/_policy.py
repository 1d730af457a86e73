"""Supervision options; restart policies: when a failed rank (or the whole group) starts again.

The model is Erlang/OTP's supervisor: a *strategy* says what restarts
(``one_for_all``: the whole group; ``one_for_one``: the failed rank alone),
and an *intensity* (``max_restarts`` within ``window`` seconds) says when to
give up and report the failure instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ._spec import check_seconds

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Backoff", "RestartPolicy", "RestartRecord", "Supervision"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait before a restart: ``initial * factor ** n``, at most ``max``.

    ``n`` is how many restarts happened within the policy's ``window`` before
    this one, so the delay grows while failures come fast and falls back once
    the group has run quietly for a window.

    Raises:
        ValueError: A negative ``initial`` or ``max``, or a ``factor`` below 1.
    """

    initial: float = 0.5
    factor: float = 2.0
    max: float = 30.0

    def __post_init__(self) -> None:
        check_seconds("Backoff.initial", self.initial, allow_none=False, finite=True)
        check_seconds("Backoff.max", self.max, allow_none=False, finite=True)
        factor = self.factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not math.isfinite(factor)
            or factor < 1
        ):
            raise ValueError(
                f"Backoff.factor must be a finite number of at least 1, got {factor!r}"
            )

    def delay(self, recent_restarts: int) -> float:
        """Seconds to wait before a restart that follows ``recent_restarts`` others."""
        # Past max the exponent no longer matters, and a large one would overflow.
        exponent = min(recent_restarts, 1024)
        try:
            return float(min(self.max, self.initial * self.factor**exponent))
        except OverflowError:
            return float(self.max)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When and how a group restarts ranks instead of failing.

    Attributes:
        max_restarts: Restarts allowed within ``window`` seconds; the failure
            that would make one more is raised instead (0: never restart).
        window: The intensity window, in seconds; ``math.inf`` counts every
            restart of the group's life, as torchrun's ``--max-restarts`` does.
        backoff: The wait before each restart.
        strategy: ``"one_for_all"`` (the default; right for ranks that talk to
            each other): shut the whole group down with the usual escalation
            and start every rank again. ``"one_for_one"``: start the failed
            rank again and leave the others running.
        on: ``"failure"`` (the default): restart after a rank fails (raises,
            exits non-zero, is killed, or hangs). ``"any"``: also after a rank
            returns, for ranks that should run until stopped.

    Raises:
        ValueError: A field out of range, or an unknown strategy or ``on``.
    """

    max_restarts: int = 3
    window: float = 60.0
    backoff: Backoff = field(default_factory=Backoff)
    strategy: Literal["one_for_all", "one_for_one"] = "one_for_all"
    on: Literal["failure", "any"] = "failure"

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or self.max_restarts < 0
        ):
            raise ValueError(f"max_restarts must be a non-negative int, got {self.max_restarts!r}")
        # math.inf counts every restart, as torchrun does.
        check_seconds("window", self.window, allow_none=False, positive=True)
        if not isinstance(self.backoff, Backoff):
            raise TypeError(f"backoff must be an aiospawn.Backoff, got {self.backoff!r}")
        if self.strategy not in ("one_for_all", "one_for_one"):
            raise ValueError(
                f"strategy must be 'one_for_all' or 'one_for_one', got {self.strategy!r}"
            )
        if self.on not in ("failure", "any"):
            raise ValueError(f"on must be 'failure' or 'any', got {self.on!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartRecord:
    """One exit that a restart policy acted on, kept in the group's history.

    Attributes:
        rank: The rank that ended.
        pid: The process id it had.
        restart: Its restart count at the time (0: its first run).
        outcome: How it ended: ``"raised"``, ``"exit code 3"``, ``"SIGKILL"``,
            ``"hung"`` or ``"returned"``.
        exit_code: The exit code (negative for a signal); ``None`` for a hung
            rank, which the supervisor stopped.
        time: When it ended, as ``time.time()``.
    """

    rank: int
    pid: int
    restart: int
    outcome: str
    exit_code: int | None
    time: float

    def __str__(self) -> str:
        when = _clock(self.time)
        return f"{when} rank {self.rank} (pid {self.pid}, restart {self.restart}): {self.outcome}"


def _clock(wall_time: float) -> str:
    import time

    return (
        time.strftime("%H:%M:%S", time.localtime(wall_time)) + f".{int(wall_time % 1 * 1000):03d}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Supervision:
    """How a group is watched: the options beyond what its ranks run.

    Attributes:
        grace_period: The group's default seconds from SIGTERM to SIGKILL.
        restart: The restart policy, or None to fail at the first failure.
        heartbeat_timeout: Seconds a rank may go between heartbeats.
        startup_timeout: Seconds a rank may take to send its first heartbeat.
        clock: The monotonic clock that heartbeat timeouts, restart windows
            and backoffs are measured on; the supervision's unit tests pass a
            fake one.
    """

    grace_period: float | None = None
    restart: RestartPolicy | None = None
    heartbeat_timeout: float | None = None
    startup_timeout: float | None = None
    clock: Callable[[], float] = time.monotonic

    @property
    def watches_heartbeats(self) -> bool:
        """True when ranks get heartbeat slots and may be found hung."""
        return self.heartbeat_timeout is not None or self.startup_timeout is not None
