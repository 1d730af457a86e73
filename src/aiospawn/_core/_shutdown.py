"""Shutdown escalation: optional grace wait, SIGTERM, grace wait, SIGKILL, bounded reap.

Every live rank is signalled at once, so the grace periods overlap: N ranks
that ignore SIGTERM cost one grace period, not N. Each rank's grace period
runs from its own SIGTERM, not from the last rank's: while the ranks are
signalled, the group's owner keeps reaping those that have exited already,
and that work must not push back the SIGKILL of a rank that ignores SIGTERM.
The caller runs this shielded (see ``_concurrency``); it never waits without a
bound, and a shorter grace period asked for meanwhile (a second Ctrl-C)
hurries it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from ._backend import RankHandle
from ._concurrency import take_turn
from ._log import logger

#: Seconds between SIGTERM and SIGKILL when no ``grace_period`` is given, as in
#: ``torch.multiprocessing`` and torchrun.
DEFAULT_GRACE_PERIOD = 30.0

#: Seconds to wait for the kernel to reap ranks after SIGKILL. A rank still
#: there after that is stuck in uninterruptible sleep (state D) and is reported.
REAP_TIMEOUT = 5.0


class Shutdown:
    """One group's shutdown escalation, which a shorter grace period can hurry.

    Args:
        grace_period: Seconds from SIGTERM to SIGKILL; ``None`` means
            :data:`DEFAULT_GRACE_PERIOD`.
        wait_first: After a rank failed: when ``grace_period`` is set, first
            give the others that long to exit by themselves, as torch does.
        on_signal: Called with each rank signalled and the signal sent.
    """

    def __init__(
        self,
        grace_period: float | None,
        *,
        wait_first: bool,
        on_signal: Callable[[RankHandle, int], None] = lambda rank, signum: None,
    ) -> None:
        self._on_signal = on_signal
        self._first_wait = grace_period if wait_first and grace_period is not None else 0.0
        self._term_wait = DEFAULT_GRACE_PERIOD if grace_period is None else grace_period
        self._waiting: anyio.CancelScope | None = None  # the first wait, while it runs
        self._waiting_since = 0.0
        #: When each rank's grace period began, its SIGTERM (by ``id``).
        self._sigterm_at: dict[int, float] = {}
        #: Each rank's wait for its grace period to end, while it runs (by ``id``).
        self._graces: dict[int, tuple[anyio.CancelScope, float]] = {}

    def hurry(self, grace_period: float) -> None:
        """Send SIGKILL at most ``grace_period`` seconds after SIGTERM (0: at once)."""
        self._first_wait = min(self._first_wait, grace_period)
        self._term_wait = min(self._term_wait, grace_period)
        if self._waiting is not None:
            self._waiting.deadline = min(self._waiting.deadline, self._waiting_since + grace_period)
        for scope, since in self._graces.values():
            scope.deadline = min(scope.deadline, since + grace_period)

    async def run(
        self,
        ranks: Sequence[RankHandle],
        wait: Callable[[RankHandle], Coroutine[Any, Any, object]],
        *,
        at_once: Sequence[RankHandle] = (),
    ) -> list[RankHandle]:
        """Stop every rank of ``ranks`` that is still running, politely first.

        Args:
            ranks: The ranks to stop.
            wait: Waits for one rank's exit (the group's watch of it, which
                records the exit; called for the ranks that have not exited).
            at_once: Those of ``ranks`` that get SIGTERM without the first
                wait: they will not exit by themselves (a hung rank).

        Returns:
            The ranks that could not be reaped (stuck in the kernel), already logged.
        """
        await self._terminate(at_once)
        if self._first_wait > 0:
            self._waiting_since = anyio.current_time()
            with anyio.move_on_after(self._first_wait) as self._waiting:
                async with anyio.create_task_group() as tg:
                    for rank in ranks:
                        if rank.exit is None:
                            tg.start_soon(wait, rank)
            self._waiting = None
        live = [rank for rank in ranks if rank.exit is None]
        # The ranks signalled before the first wait get their grace period
        # from now, as the others do: the first wait was not theirs to use.
        since = anyio.current_time()
        # A rank that exited meanwhile is not signalled (send_signal checks).
        await self._terminate([rank for rank in live if rank not in at_once])
        stuck: list[RankHandle] = []
        async with anyio.create_task_group() as tg:
            for rank in live:
                if rank.exit is None:
                    start = max(since, self._sigterm_at.get(id(rank), since))
                    tg.start_soon(self._stop, rank, wait, start, stuck)
        for rank in stuck:
            logger.error(
                "Process %s (rank %d) did not exit %g s after SIGKILL; it is probably in"
                " uninterruptible sleep (state D), waiting on the kernel or a device",
                rank.pid,
                rank.rank,
                REAP_TIMEOUT,
            )
        return [rank for rank in live if rank in stuck]

    async def _terminate(self, ranks: Sequence[RankHandle]) -> None:
        if not ranks:
            return
        for rank in ranks:
            # Signalling many ranks takes a while: the loop runs other tasks
            # once a slice of our CPU is spent. Not a checkpoint per rank: the
            # group's owner reaps each rank that has exited at every
            # checkpoint, and reaping while the others are still dying of the
            # same SIGTERM cost three to five times the system time (64 fork
            # ranks: 47-90 ms against 11-20 ms, load 17-22, measured 2026-12-03).
            await take_turn()
            if rank.send_signal(signal.SIGTERM):
                self._sigterm_at[id(rank)] = anyio.current_time()
                self._on_signal(rank, signal.SIGTERM)
                logger.warning(
                    "Terminating process %s via signal SIGTERM (rank %d)", rank.pid, rank.rank
                )
        await checkpoint()

    async def _stop(
        self,
        rank: RankHandle,
        wait: Callable[[RankHandle], Coroutine[Any, Any, object]],
        since: float,
        stuck: list[RankHandle],
    ) -> None:
        """Wait out ``rank``'s grace period (begun at ``since``), then SIGKILL and reap it."""
        with anyio.move_on_at(since + self._term_wait) as scope:
            self._graces[id(rank)] = (scope, since)
            try:
                await wait(rank)
            finally:
                del self._graces[id(rank)]
        if rank.exit is not None:
            return
        if rank.send_signal(signal.SIGKILL):
            self._on_signal(rank, signal.SIGKILL)
            # The time that passed, not the grace period: a hurry (a second
            # Ctrl-C) cuts the wait short.
            logger.warning(
                "Process %s (rank %d) still running %s s after SIGTERM; sending SIGKILL",
                rank.pid,
                rank.rank,
                seconds_text(anyio.current_time() - self._sigterm_at.get(id(rank), since)),
            )
        with anyio.move_on_after(REAP_TIMEOUT):
            await wait(rank)
        if rank.exit is None:
            stuck.append(rank)


def seconds_text(seconds: float) -> str:
    """``seconds`` for a log line: one decimal under 10 s (``0.5``), whole seconds above."""
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"
