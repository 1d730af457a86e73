"""AsyncProcessContext: one rank group, from its start to the last reap.

A group's state is derived from its ranks and a few facts (start finished,
root failure, restart pending, shutdown begun), never stored twice::

    starting ──► running ──┬──────────────────────────────► reaped (all returned)
       │                   │ a rank fails (exits badly, or hangs)
       │                   ├──► restart policy allows it ──► restarting ──► running
       │                   │     (one_for_all: the group is stopped first;
       │                   │      backoff; then the slot(s) start again)
       │                   ├──► failing ───┐  optional grace wait
       │                   │ terminate() / │
       │                   │ cancellation  ▼
       │                   └──► terminating ──► SIGTERM ─► grace ─► SIGKILL ─► reaped
       │ start error or cancellation                ▲
       └────────────────────────────────────────────┘

Each slot holds the current attempt at its rank (a ``RankHandle`` from the
group's launcher; a restart puts a new one in the slot). Every exit is seen by
exactly one watcher (``RankHandle.wait``) and reported through
:meth:`AsyncProcessContext._on_exit`. The first failure that the restart
policy does not absorb, not caused by us, is the root cause; every ``join()``
raises an exception equal to the one built from it.

Supervision runs in whichever task waits on the group (``join()`` or an
``async with`` block), one at a time (:meth:`AsyncProcessContext._supervise`);
the others wait for it. It can stop and resume at any point: a pending
restart keeps its due time, and a rank's watcher resumes where it stopped.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, final

import anyio
import anyio.abc
from anyio.lowlevel import checkpoint

from ._backend import Backend, GroupLauncher, RankHandle
from ._capture import CaptureBuffer, OutputLine
from ._concurrency import run_to_completion
from ._errors import ProcessException, signal_name
from ._events import (
    Event,
    EventLog,
    Exited,
    GroupStatistics,
    Hung,
    RankStatistics,
    Restarting,
    Started,
    Stopped,
    Terminating,
)
from ._log import logger
from ._outcome import Hang, RankExit
from ._policy import RestartPolicy, RestartRecord
from ._shutdown import Shutdown
from ._spec import LaunchSpec, check_seconds

__all__ = ["AsyncProcessContext"]

T = TypeVar("T")

_CONSTRUCT = object()

#: Seconds a hung rank gets to write its stacks before it is stopped anyway.
STACK_TIMEOUT = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Supervision:
    """How a group is watched: the options beyond what its ranks run."""

    grace_period: float | None = None
    restart: RestartPolicy | None = None
    heartbeat_timeout: float | None = None
    startup_timeout: float | None = None

    @property
    def watches_heartbeats(self) -> bool:
        """True when ranks get heartbeat slots and may be found hung."""
        return self.heartbeat_timeout is not None or self.startup_timeout is not None


@dataclass(slots=True)
class _PendingRestart:
    """Slots to start again once ``due`` (``time.monotonic()``) has come.

    ``stop`` lists the running ranks to stop first; ``failure`` is what the
    restart answers, raised if the restart cannot happen.
    """

    slots: list[int]
    due: float
    stop: list[RankHandle]
    failure: RankExit | Hang
    announced: bool = False


@final
class AsyncProcessContext(Generic[T]):
    """A started group of ranks, each running ``fn(rank, *args)`` in its own process.

    Made by ``start_processes(..., join=False)``, ``spawn(..., join=False)`` and
    ``open_group()``; not constructed directly. Every method may be called from
    several tasks at once: one watcher per rank does the waiting, the others
    share what it sees.

    ``async with ctx:`` supervises the group for the duration of the block,
    as :func:`aiospawn.open_group` describes.
    """

    def __init__(
        self,
        token: object,
        spec: LaunchSpec,
        launcher: GroupLauncher,
        supervision: Supervision,
        capture: CaptureBuffer | None,
    ) -> None:
        if token is not _CONSTRUCT:
            raise TypeError(
                "AsyncProcessContext is made by start_processes(join=False) or open_group()"
            )
        self._spec = spec
        self._launcher = launcher
        self._supervision = supervision
        self._grace_period = supervision.grace_period
        self._capture = capture
        self._events = EventLog()
        self._restarts = [0] * spec.nprocs
        self._ranks: list[RankHandle] = self._make_ranks(range(spec.nprocs), [0] * spec.nprocs)
        self._last_starts: list[Started | None] = [None] * spec.nprocs
        self._last_exits: list[Exited | None] = [None] * spec.nprocs
        self._started = anyio.Event()
        self._starting: anyio.Event | None = None  # set when a restart's start finishes
        self._root: RankExit | Hang | None = None
        self._pending: list[_PendingRestart] = []
        self._gave_up = False
        self._history: list[RestartRecord] = []
        self._restart_times: list[float] = []
        self._hung: set[RankHandle] = set()  # attempts found hung
        self._probing: set[RankHandle] = set()  # attempts whose stacks are being taken
        self._restart_count = 0
        self._restart_error: Exception | None = None
        self._shutdown: Shutdown | None = None
        self._shutdown_done = anyio.Event()
        self._stuck: list[RankHandle] = []
        self._results: list[T] | None = None
        self._decoding: anyio.Event | None = None  # set once a decoding has ended
        self._body: anyio.abc.TaskGroup | None = None
        self._supervisor_done: anyio.Event | None = None
        self._changed = anyio.Event()
        self._exits_seen = 0

    @classmethod
    async def _start(
        cls, spec: LaunchSpec, supervision: Supervision, backend: Backend
    ) -> AsyncProcessContext[T]:
        """Start every rank of ``spec``; on any error or cancellation, stop those that started."""
        capture = CaptureBuffer() if spec.output.captures else None
        launcher = await backend.open(spec, capture)
        self = cls(_CONSTRUCT, spec, launcher, supervision, capture)
        try:
            await self._launch(self._ranks)
        except BaseException:
            self._started.set()
            await self._shut_down(None, after_failure=False)
            raise
        self._started.set()
        return self

    @property
    def processes(self) -> list[Any]:
        """The ``multiprocessing`` process objects of the current attempts, index = rank."""
        return [rank.process for rank in self._ranks]

    def pids(self) -> list[int]:
        """The ranks' process ids (of their current attempts), index = rank."""
        return [rank.pid for rank in self._ranks if rank.pid is not None]

    @property
    def results(self) -> list[T]:
        """What each rank's ``fn`` returned, index = rank.

        Raises:
            RuntimeError: ``join()`` has not returned True yet.
        """
        if self._results is None:
            raise RuntimeError(
                "results are available once join() has returned True (every rank has"
                " returned); await ctx.join() first"
            )
        return self._results

    async def output(self) -> AsyncIterator[OutputLine]:
        """Yield the captured lines of every rank as they are written.

        Each item is an ``OutputLine(rank, stream, line)``, the line without its
        newline. Lines of one rank and stream keep their order. Iteration ends
        once every rank has exited and its last lines were delivered. Lines are
        read while the group is supervised: iterate alongside ``join()``, in an
        ``async with`` block, or around ``terminate()``. While
        nobody iterates, up to 10,000 lines are held; beyond that the ranks
        are held back (their writes block) until the consumer catches up.

        Raises:
            RuntimeError: Neither ``stdout`` nor ``stderr`` is ``"capture"``.
        """
        if self._capture is None:
            raise RuntimeError('ctx.output() needs stdout="capture" or stderr="capture"')
        async for line in self._capture.lines():
            yield line

    def events(self) -> AsyncGenerator[Event, None]:
        """Yield the group's lifecycle events, from its start, as they happen.

        Each item is an immutable record (``Started``, ``Exited``, ``Hung``,
        ``Restarting``, ``Terminating``, ``Stopped``) with the rank, its pid, a
        ``time.monotonic()`` and a ``time.time()`` timestamp. Iteration ends
        after every rank's ``Stopped``. Any number of tasks may iterate at
        once, each at its own pace. Events are produced while the group is
        supervised (``join()``, an ``async with`` block, ``terminate()``).

        The group holds its newest 10,000 events and never waits for a
        consumer: one that falls further behind gets an ``EventsLost(count)``
        and goes on from the oldest event still held. To stop early, iterate
        inside ``contextlib.aclosing(ctx.events())``.
        """
        return self._events.follow()

    def statistics(self) -> GroupStatistics:
        """A snapshot: ranks alive, each rank's state, restarts, last exits."""
        pending = self._pending_slots()
        ranks = []
        for index, rank in enumerate(self._ranks):
            if index in pending and (rank.exit is not None or not rank.started):
                state = "restarting"
            elif not rank.started:  # starting, or never will: its slot is done
                state = "exited" if self._finished() else "starting"
            elif rank.exit is not None:
                state = "exited"
            elif self._shutdown is not None or rank in self._hung or index in pending:
                state = "stopping"
            else:
                state = "running"
            ranks.append(
                RankStatistics(
                    rank=index,
                    pid=rank.pid,
                    state=state,
                    restarts=self._restarts[index],
                    last_start=self._last_starts[index],
                    last_exit=self._last_exits[index],
                )
            )
        alive = sum(1 for rank in self._ranks if rank.started and rank.exit is None)
        return GroupStatistics(alive=alive, restarts=self._restart_count, ranks=tuple(ranks))

    async def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for every rank to finish; on the first failure, stop the rest and raise.

        Idempotent: once it has returned True it keeps returning True, and once
        it has raised, every later call raises an equal exception (same class,
        ``error_index`` and message), never one about a rank we stopped.
        With a ``restart`` policy, a failure it absorbs is not raised: the
        rank (or group) is started again and ``join()`` goes on waiting.

        Args:
            timeout: Seconds to wait; ``None`` waits as long as it takes and
                ``0`` checks once without waiting. Steps that must not be cut
                short finish first: a restart's start, taking a hung rank's
                stacks (at most 1 s).
            grace_period: For the shutdown this call may run (a failure, or its
                cancellation): seconds between SIGTERM and SIGKILL, and after a
                failure, how long the other ranks may first take to exit by
                themselves. ``None`` uses the group's ``grace_period``.

        Returns:
            True once every rank has exited successfully (see :attr:`results`);
            False if ``timeout`` passed with ranks still running.

        Raises:
            ProcessRaisedException: A rank's ``fn`` raised; raised after the
                other ranks have been shut down and reaped.
            ProcessExitedException: A rank exited with a non-zero code or was
                killed by a signal (or, after ``terminate()``, the lowest rank
                that the shutdown stopped).
            ProcessHungException: A rank stopped sending heartbeats.
            ValueError: ``timeout`` or ``grace_period`` is negative.

        Cancellation:
            Cancelling the task awaiting ``join()`` shuts the group down
            (SIGTERM, grace period, SIGKILL) and reaps every rank, then
            re-raises the cancellation unchanged. A second cancellation,
            including a native ``asyncio`` one, does not cut that short.
        """
        check_seconds("timeout", timeout)
        check_seconds("grace_period", grace_period)
        return await self._join(timeout, grace_period, until_all=True)

    async def terminate(self, grace_period: float | None = None) -> None:
        """Shut down every rank still running: SIGTERM, grace period, SIGKILL, reap.

        Idempotent, and safe at any time: ranks still starting are signalled
        once their start has finished, and a pending restart is dropped.
        Ranks that already exited are left alone.
        Called while a shutdown is under way, it waits for that one, and a
        ``grace_period`` shorter than what is left of it hurries it: SIGKILL
        comes at most ``grace_period`` seconds after SIGTERM (``0``: now).
        A later ``join()`` raises :class:`ProcessExitedException` for the lowest
        rank this stopped, or returns True if every rank had already succeeded.

        Args:
            grace_period: Seconds between SIGTERM and SIGKILL; ``None`` uses the
                group's ``grace_period``, or 30 s if that is ``None`` too.

        Raises:
            ValueError: ``grace_period`` is negative.

        Cancellation:
            The shutdown runs to the end (every rank reaped) before the
            cancellation is re-raised.
        """
        check_seconds("grace_period", grace_period)
        await self._shut_down(grace_period, after_failure=False)

    async def __aenter__(self) -> Self:
        if self._body is not None:
            raise RuntimeError(f"{self!r} is already supervising an async with block")
        body = anyio.create_task_group()
        await body.__aenter__()
        body.start_soon(self._supervise)
        self._body = body
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        body, self._body = self._body, None
        assert body is not None
        try:
            if exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
                # The block raised: stop the ranks and let its exception through,
                # unwrapped (a task group would put it in an ExceptionGroup).
                body.cancel_scope.cancel()
                await body.__aexit__(None, None, None)
                await self._shut_down(None, after_failure=False)
                return False
            ours = await body.__aexit__(exc_type, exc, tb)
        except BaseException:
            await self._shut_down(None, after_failure=False)
            raise
        if exc is not None and not ours:  # cancelled from outside the block
            await self._shut_down(None, after_failure=False)
            return False
        # The block ended, or we cancelled it because a rank failed: finish as
        # join() does, which raises that failure.
        await self.join()
        return exc is not None

    def __repr__(self) -> str:
        if not self._started.is_set():
            state = " starting"
        else:
            running = sum(1 for rank in self._ranks if rank.started and rank.exit is None)
            state = f" running={running}"
        if self._restart_count:
            state += f" restarts={self._restart_count}"
        if self._root is not None:
            state += f" failed=rank {self._root.rank} ({self._root.summary()})"
        return f"<AsyncProcessContext nprocs={len(self._ranks)}{state}>"

    # ------------------------------------------------------------------ exits

    def _on_exit(self, exit: RankExit) -> None:
        """Record one attempt's exit (called once per attempt, on the loop thread)."""
        handle = self._ranks[exit.rank]
        exited = Exited(
            rank=exit.rank,
            pid=exit.pid,
            exit_code=exit.exit_code,
            signal_name=signal_name(exit.exit_code) if exit.exit_code < 0 else None,
            outcome=exit.summary(),
            stopped_by_us=exit.stopped_by_us,
        )
        self._last_exits[exit.rank] = exited
        self._events.append(exited)
        self._exits_seen += 1
        if not exit.stopped_by_us and handle not in self._hung:
            policy = self._supervision.restart
            if not exit.succeeded or (policy is not None and policy.on == "any"):
                self._failed(exit, handle)
        if exit.rank not in self._pending_slots():
            self._events.append(Stopped(rank=exit.rank, pid=exit.pid))
        self._close_if_over()
        self._notify()

    def _failed(self, failure: RankExit | Hang, handle: RankHandle) -> None:
        """Restart as the policy allows, or make ``failure`` the group's root cause."""
        if self._root is not None:
            return
        policy = self._supervision.restart
        if policy is None or self._shutdown is not None:
            # A failure found while the group shuts down still caused it; no
            # restart can follow a shutdown.
            self._give_up(failure)
            return
        if policy.strategy == "one_for_all" and self._pending:
            return  # the group is being restarted: this is a consequence, not a cause
        self._history.append(
            RestartRecord(
                rank=failure.rank,
                pid=failure.pid,
                restart=self._restarts[failure.rank],
                outcome=failure.summary(),
                exit_code=failure.exit_code if isinstance(failure, RankExit) else None,
                time=time.time(),
            )
        )
        now = time.monotonic()
        recent = [moment for moment in self._restart_times if now - moment < policy.window]
        if len(recent) >= policy.max_restarts:
            self._gave_up = True
            self._give_up(failure)
            return
        self._restart_times = [*recent, now]
        if policy.strategy == "one_for_all":
            slots = list(range(len(self._ranks)))
            stop = [rank for rank in self._ranks if rank.started and rank.exit is None]
        else:
            slots = [failure.rank]
            stop = [handle] if handle.exit is None else []
        delay = policy.backoff.delay(len(recent))
        self._pending.append(_PendingRestart(slots, now + delay, stop, failure))
        logger.warning(
            "Rank %d (pid %d) failed (%s); restarting %s in %.3g s (restart %d of at most %d"
            " within %g s)\n%s",
            failure.rank,
            failure.pid,
            failure.summary(),
            "the group" if policy.strategy == "one_for_all" else "it",
            delay,
            len(recent) + 1,
            policy.max_restarts,
            policy.window,
            str(failure.exception()).strip("\n"),
        )

    def _give_up(self, failure: RankExit | Hang) -> None:
        self._root = failure
        self._drop_pending()
        if self._body is not None:  # an async with block runs: stop it now
            self._body.cancel_scope.cancel()

    def _drop_pending(self) -> None:
        """Cancel the pending restarts: the slots that wait for one are finished."""
        for index in sorted(self._pending_slots()):
            rank = self._ranks[index]
            if rank.exit is not None:
                self._events.append(Stopped(rank=index, pid=rank.pid))
        self._pending.clear()

    def _pending_slots(self) -> set[int]:
        return {index for pending in self._pending for index in pending.slots}

    def _over(self) -> bool:
        """True once no rank runs and none will be started again."""
        return not self._pending and all(
            rank.exit is not None
            or (self._started.is_set() and self._starting is None and not rank.started)
            for rank in self._ranks
        )

    def _close_if_over(self) -> None:
        """End the events and output iterations once nothing more can come."""
        if self._over():
            self._events.close()
            if self._capture is not None:
                self._capture.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # ------------------------------------------------------------ supervision

    async def _join(
        self, timeout: float | None, grace_period: float | None, *, until_all: bool
    ) -> bool:
        """``join()``; with ``until_all=False`` it also returns (False) after any one exit."""
        try:
            await checkpoint()
            if self._root is None and self._shutdown is None:
                exited = self._exits_seen
                for rank in self._ranks:
                    rank.poll()
                # Without until_all, an exit this poll found is the one to report.
                wait = until_all or self._exits_seen == exited
                if wait and self._root is None and not self._over() and timeout != 0:
                    with anyio.move_on_after(math.inf if timeout is None else timeout):
                        if until_all:
                            await self._supervise()
                        else:
                            await self._supervise_until_an_exit()
        except BaseException:
            await self._shut_down(grace_period, after_failure=False)
            raise
        if self._root is not None or self._shutdown is not None:
            await self._shut_down(grace_period, after_failure=self._root is not None)
            error = self._error()
            if error is not None:
                try:
                    raise error
                finally:
                    # The traceback holds this frame: a local bound to the
                    # exception would keep both alive until the cyclic GC runs.
                    del error
        if not self._over():
            return False
        await run_to_completion(self._launcher.aclose)
        await self._collect_results()
        return True

    async def _supervise_until_an_exit(self) -> None:
        exited = self._exits_seen
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._supervise)
            while self._exits_seen == exited and not self._finished():
                await self._changed.wait()
            tg.cancel_scope.cancel()

    async def _supervise(self) -> None:
        """Watch the group until it is over or has failed; one task at a time."""
        while not self._finished():
            if self._supervisor_done is not None:
                await self._supervisor_done.wait()
                continue
            self._supervisor_done = done = anyio.Event()
            try:
                await self._run_supervisor()
            finally:
                self._supervisor_done = None
                done.set()

    def _finished(self) -> bool:
        return self._root is not None or self._shutdown is not None or self._over()

    async def _run_supervisor(self) -> None:
        async with anyio.create_task_group() as watchers:
            self._watch(watchers, self._ranks)
            if self._supervision.watches_heartbeats:
                watchers.start_soon(self._watch_heartbeats)
            while not self._finished():
                changed = self._changed
                if self._pending:
                    await self._restart(watchers, changed)
                else:
                    await changed.wait()
            watchers.cancel_scope.cancel()

    def _watch(self, watchers: anyio.abc.TaskGroup, ranks: Iterable[RankHandle]) -> None:
        for rank in ranks:
            if rank.started and rank.exit is None:
                watchers.start_soon(rank.wait)

    async def _restart(self, watchers: anyio.abc.TaskGroup, changed: anyio.Event) -> None:
        """Make progress on the pending restarts: stop, back off, start again.

        Returns after each step, or when something changed, so that the
        supervisor looks at the group afresh (a new failure, a shutdown).
        """
        stop = [rank for pending in self._pending for rank in pending.stop]
        if stop:
            failure = self._pending[0].failure
            for pending in self._pending:
                pending.stop = []
            shutdown = Shutdown(self._grace_period, wait_first=False, on_signal=self._signalled)
            stuck = await run_to_completion(lambda: shutdown.run(stop))
            if stuck:  # a rank that cannot be reaped cannot be replaced either
                self._stuck += stuck
                self._failed_restart(failure, None)
            return
        now = time.monotonic()
        for pending in self._pending:
            if not pending.announced:
                pending.announced = True
                for index in pending.slots:
                    self._events.append(
                        Restarting(
                            rank=index,
                            pid=self._ranks[index].pid,
                            attempt=self._restarts[index] + 1,
                            delay=max(0.0, pending.due - now),
                        )
                    )
        first = min(self._pending, key=lambda pending: pending.due)
        with anyio.move_on_after(first.due - now):
            await changed.wait()
            return
        if first not in self._pending or self._finished():
            return  # dropped (terminate(), a failure the policy gave up on) meanwhile
        self._pending.remove(first)
        # Started to the end, whoever is cancelled meanwhile: a slot left with
        # an attempt that never started would read as finished.
        try:
            fresh = await run_to_completion(lambda: self._start_again(first.slots))
        except Exception as exc:
            self._failed_restart(first.failure, exc)
            return
        self._restart_count += 1
        self._watch(watchers, fresh)
        self._notify()  # the heartbeat watcher has new ranks to watch

    async def _start_again(self, slots: Sequence[int]) -> list[RankHandle]:
        """Make and start the next attempt at each of ``slots``."""
        if len(slots) == len(self._ranks):
            self._launcher.new_rendezvous()
        fresh = self._make_ranks(slots, [self._restarts[index] + 1 for index in slots])
        for rank in fresh:
            self._hung.discard(self._ranks[rank.rank])
            self._restarts[rank.rank] += 1
            self._ranks[rank.rank] = rank
        self._starting = starting = anyio.Event()
        try:
            await self._launch(fresh)
        finally:
            self._starting = None
            starting.set()
        return fresh

    def _make_ranks(self, slots: Sequence[int], restarts: Sequence[int]) -> list[RankHandle]:
        """Make (not start) an attempt for each slot; on an error, release those made."""
        made: list[RankHandle] = []
        try:
            for index, restart in zip(slots, restarts, strict=True):
                made.append(self._launcher.make_rank(index, restart, self._on_exit))
        except BaseException:
            for rank in made:
                rank.discard()
            raise
        return made

    def _failed_restart(self, failure: RankExit | Hang, error: Exception | None) -> None:
        """A restart could not happen: the failure it answered is the group's root cause."""
        if self._root is None:
            self._restart_error = error
            self._give_up(failure)
        self._notify()

    async def _launch(self, ranks: Sequence[RankHandle]) -> None:
        try:
            await self._launcher.start(ranks)
        finally:  # those that started, even when others could not
            for rank in ranks:
                if rank.started:
                    started = Started(
                        rank=rank.rank, pid=rank.pid, restart=self._restarts[rank.rank]
                    )
                    self._last_starts[rank.rank] = started
                    self._events.append(started)

    async def _watch_heartbeats(self) -> None:
        """Find ranks that stopped beating (or never began) and report them hung."""
        while True:
            changed = self._changed
            found = self._find_hung()
            if not isinstance(found, tuple):
                with anyio.move_on_after(found):  # or sooner: ranks (re)started
                    await changed.wait()
                continue
            rank, seconds, began, limit = found
            await self._on_hung(rank, seconds, began=began, limit=limit)

    def _find_hung(self) -> tuple[RankHandle, float, bool, float] | float:
        """A hung rank with its figures, or else the seconds until one could be."""
        if self._shutdown is not None:  # every rank is being stopped anyway
            return math.inf
        now = time.monotonic()
        next_check = math.inf
        restarting = self._pending_slots()
        for rank in self._ranks:
            if not rank.started or rank.exit is not None or rank in self._hung:
                continue
            if rank.rank in restarting or rank in self._probing:
                continue
            beat = rank.last_beat()
            limit = (
                self._supervision.heartbeat_timeout
                if beat is not None
                else self._supervision.startup_timeout
            )
            if limit is None:  # no first beat yet, and no startup_timeout
                # Nothing tells us of a first beat: look again within the timeout.
                assert self._supervision.heartbeat_timeout is not None
                next_check = min(next_check, now + self._supervision.heartbeat_timeout)
                continue
            started = self._last_starts[rank.rank]
            assert started is not None
            since = beat if beat is not None else started.time
            if now - since >= limit:
                return rank, now - since, beat is not None, limit
            next_check = min(next_check, since + limit)
        return max(0.0, next_check - now)

    async def _on_hung(
        self, rank: RankHandle, seconds: float, *, began: bool, limit: float
    ) -> None:
        # To the end, even if the supervising call is cancelled meanwhile (a
        # join() timeout): the stack is taken once, and the hang recorded.
        await run_to_completion(lambda: self._report_hang(rank, seconds, began, limit))

    async def _report_hang(
        self, rank: RankHandle, seconds: float, began: bool, limit: float
    ) -> None:
        pid = rank.pid
        assert pid is not None
        self._probing.add(rank)
        try:
            stack = await rank.stack(STACK_TIMEOUT)
        finally:
            self._probing.discard(rank)
        if rank.exit is not None or self._shutdown is not None:
            return  # it exited meanwhile, and that exit was reported as any other
        self._hung.add(rank)
        self._events.append(Hung(rank=rank.rank, pid=pid, seconds=seconds, stack=stack))
        hang = Hang(
            rank=rank.rank, pid=pid, seconds=seconds, began=began, timeout=limit, stack=stack
        )
        self._failed(hang, rank)
        self._notify()

    def _signalled(self, rank: RankHandle, signum: int) -> None:
        self._events.append(
            Terminating(rank=rank.rank, pid=rank.pid, signal_name=signal.Signals(signum).name)
        )

    async def _shut_down(self, grace_period: float | None, *, after_failure: bool) -> None:
        """Run the group's one shutdown, or wait for the one under way; both shielded.

        A ``grace_period`` given while a shutdown is under way hurries it.
        """
        if self._shutdown is not None:
            if grace_period is not None:
                self._shutdown.hurry(grace_period)
            await run_to_completion(self._shutdown_done.wait)
            return
        grace = self._grace_period if grace_period is None else grace_period
        self._shutdown = shutdown = Shutdown(
            grace, wait_first=after_failure, on_signal=self._signalled
        )
        self._drop_pending()
        self._notify()  # the supervisor stops: the shutdown takes over
        done = self._shutdown_done

        async def escalate() -> None:
            try:
                await self._started.wait()
                while self._starting is not None:  # a restart is starting ranks
                    await self._starting.wait()
                started = [rank for rank in self._ranks if rank.started]
                hung = [rank for rank in started if rank in self._hung]
                self._stuck += await shutdown.run(started, at_once=hung)
                await self._launcher.aclose()
            finally:
                # Nothing more can come, even from a rank stuck in the kernel.
                self._events.close()
                if self._capture is not None:
                    self._capture.close()
                done.set()

        await run_to_completion(escalate)

    def _error(self) -> ProcessException | None:
        """The exception ``join()`` raises once the group has been shut down, if any."""
        # A rank stuck in the kernel may have been released since.
        self._stuck = [rank for rank in self._stuck if rank.poll() is None]
        if self._root is not None:
            error = self._root.exception()
        else:
            stopped = [rank.exit for rank in self._ranks if rank.exit and not rank.exit.succeeded]
            if stopped:
                error = stopped[0].exception()
            elif self._stuck:
                rank = self._stuck[0]
                error = ProcessException(
                    f"process {rank.rank} did not exit after SIGKILL", rank.rank, rank.pid or 0
                )
            else:
                return None
        for rank in self._stuck:
            error.add_note(
                f"rank {rank.rank} (pid {rank.pid}) did not exit after SIGKILL and could not be"
                " reaped: it is probably in uninterruptible sleep (state D)"
            )
        if self._history:
            error.restarts = tuple(self._history)
        if self._restart_error is not None:
            error.add_note(f"aiospawn could not restart after it: {self._restart_error!r}")
        if self._gave_up:
            policy = self._supervision.restart
            assert policy is not None
            lines = "\n".join(f"    {record}" for record in self._history)
            error.add_note(
                f"restart policy gave up: more than max_restarts={policy.max_restarts}"
                f" failures within {policy.window:g} s; the failures, oldest first:\n{lines}"
            )
        return error

    async def _collect_results(self) -> None:
        # One decoding at a time: it lets the pickles go once it has succeeded.
        while self._results is None:
            if self._decoding is not None:
                await self._decoding.wait()
                continue  # decoded, or failed: then decode (and fail) here too
            self._decoding = decoding = anyio.Event()
            exits = [rank.exit for rank in self._ranks]
            try:
                # Always on a worker thread: unpickling runs the ranks' code (a
                # class's module import, a __reduce__ callable), which may take
                # any time whatever the size. The hop costs tens of
                # microseconds, once a group.
                self._results = await anyio.to_thread.run_sync(_decode_results, exits)
            finally:
                self._decoding = None
                decoding.set()


def _decode_results(exits: Sequence[RankExit | None]) -> list[Any]:
    """Every rank's value, index = rank; the pickles are dropped once all decoded."""
    values = []
    for exit in exits:
        assert exit is not None
        values.append(exit.value())  # raises the rank's ProcessRaisedException
    for exit in exits:
        assert exit is not None
        exit.release_payload()
    return values
