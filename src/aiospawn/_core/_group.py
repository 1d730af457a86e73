"""The supervisor of one rank group, from its start to the last reap.

(About 770 lines: this is the state machine and the waits on it; see the
architecture page. Its transitions, an exit, a failure, a restart, a hang,
the shutdown, read and write the same few facts; what has a concern of its
own is apart: the live ranks in ``_live``, carrying out restarts in
``_restarts``, the hang monitor in ``_hangs``, the escalation in
``_shutdown``, what a group's end reports in ``_outcome``.)

:class:`~aiospawn.AsyncProcessContext` is the public handle; this module's
:class:`Group` owns the state and drives it. A group's state is derived from
its ranks and a few facts (start finished, root failure, restart pending,
shutdown begun), never stored twice::

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
the owner's watch of that attempt and recorded by :meth:`Group._record_exit`.
What follows a failure is the restart policy's decision, which
:class:`~._restarts.Restarts` carries out; which ranks are hung,
:class:`~._hangs.HangMonitor` finds; the exception and the results are built
by ``_outcome``. Of the failures that the restart policy does not absorb, not
caused by us, the one that ended first is the root cause (by when it ended,
not when the group learnt of it: one poll may find several exits); every
``join()`` raises an exception equal to the one built from it.

One task, the group's **owner** (:meth:`Group._own`), drives it from the
start of its ranks to their last reap, whether or not anyone waits on the
group: it starts the ranks, watches each attempt (its exit; its channel's
pump, from :class:`~._live.LiveRanks`), runs the hang monitor as a task of its
own, takes each restart step and runs the shutdown. Those objects see the
group only through what it passes them (the current attempts, its clock,
event log and change notice, the restart tracker it reads too) and act on it
only through the callables it gives them. Everything else (``join()``,
``wait_ready()``, calls, the end of an ``async with`` block, ``terminate()``)
reads the state the owner keeps and waits for it to change; a shutdown is
asked of the owner, never run beside it. Where the owner runs (see
:func:`~._concurrency.start_owner`): a task of the event loop itself, which
ends, at the latest, with the loop; the forms of the API that have a scope
(``spawn()``, ``open_group()``, ``join()``) wait for it to end before they
return.

The internal interface that ``aiospawn.sync`` uses, beside the handle's:
:meth:`Group.wait_step` (``join()`` that also returns after any one exit, as
torch's ``join()`` does), :meth:`Group.unjoined` and :meth:`Group.attempt`.
"""

from __future__ import annotations

import contextvars
import math
import signal
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.abc
from anyio.lowlevel import checkpoint

from ._backend import Backend, GroupLauncher, RankHandle
from ._capture import CaptureBuffer
from ._channel import RankChannel
from ._concurrency import Broadcast, run_to_completion, start_owner
from ._errors import signal_name
from ._events import (
    EventLog,
    Exited,
    GroupStatistics,
    Hung,
    RankStatistics,
    Started,
    Stopped,
    Terminating,
)
from ._live import LiveRanks
from ._log import logger
from ._outcome import (
    BrokenChannel,
    Failure,
    Hang,
    RankExit,
    decode_results,
    ended_before,
    group_error,
)
from ._policy import Supervision
from ._restarts import GroupView, Restarts, RestartTracker
from ._shutdown import Shutdown
from ._spec import LaunchSpec

if TYPE_CHECKING:
    # Imported by the groups that watch heartbeats, when they are made.
    from ._hangs import HangMonitor

T = TypeVar("T")

#: Set for the groups started from a context that stands in for
#: ``torch.multiprocessing`` (``aiospawn.sync``): a failure stops the other
#: ranks at the next ``join()``, with its grace period, as torch's does.
_failure_waits_for_join: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "aiospawn_failure_waits_for_join", default=False
)


def stop_on_join() -> None:
    """Have the groups started from this context act on a failure in ``join()``."""
    _failure_waits_for_join.set(True)


class Group(Generic[T]):
    """The state of one rank group, and the owner task that moves it on."""

    def __init__(
        self,
        spec: LaunchSpec,
        launcher: GroupLauncher,
        supervision: Supervision,
        capture: CaptureBuffer | None,
    ) -> None:
        self.spec = spec
        self.capture = capture
        self.events = EventLog()
        self._launcher = launcher
        self._supervision = supervision
        self._clock = supervision.clock
        self._changed = Broadcast()
        self._hangs: HangMonitor | None = None
        if supervision.watches_heartbeats:
            # Here, not at the top: most groups watch no heartbeats, and the
            # module's four dataclasses took 3-4 ms of the first call.
            from ._hangs import HangMonitor, HangWatch

            watch = HangWatch(
                heartbeat_timeout=supervision.heartbeat_timeout,
                startup_timeout=supervision.startup_timeout,
            )
            self._hangs = HangMonitor(
                watch,
                clock=self._clock,
                changed=self._changed,
                running=self._running_attempts,
                shutting_down=lambda: self._shutdown is not None,
                report=self._hung,
            )
        self._tracker = RestartTracker(supervision.restart)  # read here, moved on by:
        self._restarts = Restarts(
            self._tracker,
            clock=self._clock,
            changed=self._changed,
            events=self.events,
            stop=self._stop_attempts,
            start_again=self._start_again,
            give_up=self._failed_restart,
        )
        self._numbers = [0] * spec.nprocs  # per slot: the current attempt's number
        self._live = LiveRanks(
            spec.nprocs,
            self.attempt,
            transport=type(launcher).__name__,
            events=self.events,
            changed=self._changed,
            on_broken=self._on_broken,
            exit_of=self._exit_of,
        )
        self._ranks: list[RankHandle] = self._make_ranks(range(spec.nprocs))
        self._last_starts: list[Started | None] = [None] * spec.nprocs
        self._last_exits: list[Exited | None] = [None] * spec.nprocs
        self._started = anyio.Event()  # the first start has finished (or failed)
        self._start_error: Exception | None = None
        self._starting: anyio.Event | None = None  # set when a restart's start finishes
        self._root: Failure | None = None
        self._restart_error: Exception | None = None
        # Attempts found failed while they ran (hung, or they broke their
        # channel): we stop them, and their exit is never the cause.
        self._faulty: set[RankHandle] = set()
        self._recorded: set[RankHandle] = set()  # attempts whose exit the owner recorded
        self._shutdown: Shutdown | None = None  # asked for: the owner runs it
        self._stuck: list[RankHandle] = []
        self._results: list[T] | None = None
        self._decoding: anyio.Event | None = None  # set once a decoding has ended
        self._block: anyio.CancelScope | None = None  # an async with block's
        self._owned: anyio.abc.TaskGroup | None = None  # the owner's tasks, while it runs
        self._first_start: anyio.CancelScope | None = None
        self._broken_owner: BaseException | None = None  # a defect of ours, raised by join()
        self._done = anyio.Event()  # the owner has ended: every rank reaped, all released
        self._exits_seen = 0
        self._exits_reported = 0  # ... of which wait_step() has returned for
        self._terminated = False  # terminate() was asked before any failure
        # As torch's groups do, aiospawn.sync's act on a failure in join().
        self._failure_waits_for_join = _failure_waits_for_join.get()

    @classmethod
    async def start(cls, spec: LaunchSpec, supervision: Supervision, backend: Backend) -> Group[T]:
        """Start every rank of ``spec`` under a new owner.

        Returns once every start has finished. On a start error, or if the
        caller is cancelled meanwhile, the ranks that started are stopped and
        reaped first, then the error or cancellation propagates.
        """
        capture = CaptureBuffer() if spec.output.captures else None
        launcher = await backend.open(spec, capture)
        try:
            self = cls(spec, launcher, supervision, capture)
        except BaseException:  # making a rank failed: no rank has started
            await run_to_completion(launcher.aclose)
            raise
        start_owner(self._own)
        try:
            await self._started.wait()
        except BaseException:
            await self._stop(None)
            raise
        if self._start_error is not None:
            await run_to_completion(self._done.wait)
            raise self._start_error
        return self

    # ------------------------------------------------------------ what it shows

    @property
    def attempts(self) -> list[RankHandle]:
        """The current attempt at each rank, index = rank."""
        return list(self._ranks)

    def attempt(self, index: int) -> RankHandle:
        """The current attempt at rank ``index``."""
        return self._ranks[index]

    def unjoined(self) -> list[int]:
        """The ranks whose exit has not been seen (never started, running, or stuck)."""
        return [rank.rank for rank in self._ranks if rank not in self._recorded]

    @property
    def results(self) -> list[T] | None:
        """What each rank returned, once ``join()`` has returned True."""
        return self._results

    def statistics(self) -> GroupStatistics:
        """A snapshot: ranks alive, each rank's state, restarts, last exits."""
        pending = self._tracker.pending_slots()
        ranks = []
        for index, rank in enumerate(self._ranks):
            exited = rank in self._recorded
            if index in pending and (exited or not rank.started):
                state = "restarting"
            elif not rank.started:  # starting, or never will: its slot is done
                state = "exited" if self._finished() else "starting"
            elif exited:
                state = "exited"
            elif self._shutdown is not None or rank in self._faulty or index in pending:
                state = "stopping"
            else:
                state = "running"
            ranks.append(
                RankStatistics(
                    rank=index,
                    pid=rank.pid,
                    state=state,
                    restarts=self._numbers[index],
                    last_start=self._last_starts[index],
                    last_exit=self._last_exits[index],
                    ready=self._live.is_ready(rank) and rank not in self._recorded,
                )
            )
        return GroupStatistics(
            alive=self._running(), restarts=self._tracker.restarts, ranks=tuple(ranks)
        )

    def summary(self) -> str:
        """The state, as the handle's ``repr`` shows it: `` running=3 failed=rank 2 (SIGKILL)``."""
        state = f" running={self._running()}" if self._started.is_set() else " starting"
        if self._tracker.restarts:
            state += f" restarts={self._tracker.restarts}"
        if self._root is not None:
            state += f" failed=rank {self._root.rank} ({self._root.summary()})"
        return state

    def _running(self) -> int:
        return sum(1 for rank in self._ranks if rank.started and rank not in self._recorded)

    # ----------------------------------------------------------- live ranks

    def channel(self, index: int) -> RankChannel:
        """The channel of rank ``index``'s current attempt."""
        return self._live.channel(index)

    async def wait_ready(self, timeout: float | None) -> list[Any]:
        """``AsyncProcessContext.wait_ready()``, its argument checked."""
        limit = self._supervision.startup_timeout if timeout is None else timeout
        self._live.check()  # every rank has a channel
        await checkpoint()
        with anyio.move_on_after(math.inf if limit is None else limit) as deadline:
            while self._root is None and self._shutdown is None and not self._over():
                if self._live.all_ready() and not self._restarts.pending and self._starting is None:
                    break
                await self._changed.wait()
        if self._root is not None or self._shutdown is not None:
            await self._join(0, None, until_all=True)  # raises the group's failure
        return await self._live.ready_payloads(limit if deadline.cancelled_caught else None)

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        ranks: Sequence[int] | None,
        timeout: float | None,
    ) -> list[Any]:
        """``AsyncProcessContext.call()``, its arguments checked."""
        return await self._live.call(method, args, kwargs, ranks, timeout)

    def close_channels(self) -> None:
        """Close the supervisor's side of every channel: a rank's ``serve()`` returns."""
        self._live.close_sending()

    def _on_broken(self, rank: RankHandle, broken: BrokenChannel) -> None:
        """``rank`` sent a frame that breaks the format: it has failed, as a hung rank has."""
        current = rank is self._ranks[rank.rank] and rank not in self._faulty
        if not current or rank in self._recorded or self._shutdown is not None:
            # A past attempt, one whose exit is recorded already, or a group
            # being stopped anyway (as for a hang found then): the channel's
            # readers get the error; the group reports what it reports.
            return
        logger.warning(
            "Rank %d (pid %d) broke its channel: it sent %s", rank.rank, broken.pid, broken.reason
        )
        self._faulted(rank, broken)

    # ---------------------------------------------------------- what it is asked

    async def join(self, timeout: float | None, grace_period: float | None) -> bool:
        """``AsyncProcessContext.join()``, its arguments checked."""
        return await self._join(timeout, grace_period, until_all=True)

    async def wait_step(self, timeout: float | None, grace_period: float | None) -> bool:
        """:meth:`join`, which also returns (False) after any one exit, as torch's does."""
        return await self._join(timeout, grace_period, until_all=False)

    async def terminate(self, grace_period: float | None) -> None:
        """``AsyncProcessContext.terminate()``, its argument checked."""
        if self._root is None:
            self._terminated = True  # a block that ends now ends without an error
        await self._stop(grace_period)

    @property
    def in_block(self) -> bool:
        """True while an ``async with`` block runs on the group."""
        return self._block is not None

    async def enter_block(self) -> None:
        """Begin an ``async with`` block: a failure of the group cancels it."""
        assert self._block is None
        # No checkpoint before the scope is entered: a cancellation there
        # would leave the started group with no block to stop it.
        self._block = anyio.CancelScope()
        self._block.__enter__()
        if self._root is not None:
            self._block.cancel()

    async def exit_block(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """End the block: as ``join()`` if it ended, else shut down; True to swallow ``exc``."""
        block, self._block = self._block, None
        assert block is not None
        if exc is None:
            self.close_channels()  # the block is done with the ranks: their serve() returns
        try:
            ours = bool(block.__exit__(exc_type, exc, tb))
        except BaseException:
            await self._stop(None)
            raise
        if exc is not None and not ours:
            # The block raised, or was cancelled from outside: stop the ranks
            # and let its exception through, unwrapped.
            await self._stop(None)
            return False
        if exc is None and self._terminated and self._root is None:
            # The block's own terminate() stopped the group: not an error.
            await run_to_completion(self._done.wait)
            if self._root is None:
                await self._collect_results(stopped_as_none=True)
                return False
        # The block ended, or we cancelled it because a rank failed: finish as
        # join() does, which raises that failure.
        await self.join(None, None)
        return exc is not None

    async def _join(
        self, timeout: float | None, grace_period: float | None, *, until_all: bool
    ) -> bool:
        try:
            await checkpoint()
            await self._see_exits()
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                # Without until_all, any exit not reported yet is the one to report.
                while not self._finished() and (
                    until_all or self._exits_seen == self._exits_reported
                ):
                    await self._changed.wait()
            self._exits_reported = self._exits_seen
            if self._over() and self._root is None and self._shutdown is None:
                await self._done.wait()  # released, the launcher closed
        except BaseException:
            await self._stop(grace_period)
            raise
        if self._root is not None or self._shutdown is not None or self._broken_owner is not None:
            self._ask_shutdown(grace_period, after_failure=self._root is not None)
            await self._stop(grace_period)
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
        await self._collect_results()
        return True

    async def _see_exits(self) -> None:
        """Wait until the owner has recorded the exits that have happened already.

        A rank may have exited a moment ago, its exit fd readable, its watcher
        not yet scheduled: a ``join(0)`` must still see it, as
        ``multiprocessing``'s does. Only asked (``exited()``): the owner reaps.
        """
        ended = [rank for rank in self._ranks if rank.started and rank.exited()]
        while not self._done.is_set() and any(rank not in self._recorded for rank in ended):
            await self._changed.wait()

    async def _collect_results(self, *, stopped_as_none: bool = False) -> None:
        # One decoding at a time: it lets the pickles go once it has succeeded.
        while self._results is None:
            if self._decoding is not None:
                await self._decoding.wait()
                continue  # decoded, or failed: then decode (and fail) here too
            self._decoding = decoding = anyio.Event()
            try:
                exits = [rank.exit for rank in self._ranks]
                self._results = await decode_results(exits, stopped_as_none=stopped_as_none)
            finally:
                self._decoding = None
                decoding.set()

    async def _stop(self, grace_period: float | None) -> None:
        """Ask the owner for the shutdown (or hurry it), and wait until it is over; shielded."""
        self._ask_shutdown(grace_period, after_failure=False)
        await run_to_completion(self._done.wait)

    def _ask_shutdown(self, grace_period: float | None, *, after_failure: bool) -> None:
        """Have the owner shut the group down; a ``grace_period`` hurries one under way.

        After a failure, the others may first take the grace period to exit
        by themselves, as torch's do.
        """
        if self._shutdown is not None:
            if grace_period is not None:
                self._shutdown.hurry(grace_period)
            return
        grace = self._supervision.grace_period if grace_period is None else grace_period
        self._shutdown = Shutdown(grace, wait_first=after_failure, on_signal=self._signalled)
        self._drop_pending()
        if self._first_start is not None:  # the ranks still starting need not start
            self._first_start.cancel()
        self._changed.notify()

    # --------------------------------------------------------------- the owner

    async def _own(self) -> None:
        """Drive the group from the start of its ranks to their last reap.

        Runs whether or not anyone waits on the group. Ends once every rank
        has been reaped and everything the group holds is released. Cancelled
        (its event loop ends), it stops and reaps the ranks first.
        """
        try:
            async with anyio.create_task_group() as owned:
                self._owned = owned
                await self._start_first()
                if self._hangs is not None:
                    owned.start_soon(self._hangs.run)
                while not self._owner_done():
                    if self._restarts.pending:
                        fresh = await self._restarts.step(self._ranks, self._numbers)
                        if fresh:
                            await self._watch(fresh)
                            self._changed.notify()  # the hang monitor has new ranks to watch
                    else:
                        await self._changed.wait()
                await self._run_shutdown()
                owned.cancel_scope.cancel()
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                # A defect of ours: join() raises it; the ranks are stopped.
                self._broken_owner = exc
            self._ask_shutdown(None, after_failure=False)
            await self._run_shutdown()
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
        finally:
            self._owned = None
            await run_to_completion(self._close)

    async def _start_first(self) -> None:
        """Start the ranks; a start error is the group's, for ``Group.start`` to raise."""
        try:
            with anyio.CancelScope() as self._first_start:
                await self._launch(self._ranks)
        except Exception as exc:
            self._start_error = exc
            self._ask_shutdown(None, after_failure=False)
        finally:
            self._first_start = None
            self._started.set()
        await self._watch(self._ranks)

    async def _watch(self, ranks: Iterable[RankHandle]) -> None:
        """Start the tasks that watch each started rank's exit and read its channel.

        A rank at a time, with a checkpoint in between: the first steps of a
        rank's tasks (registering its descriptors with the loop) then run
        apart from the next rank's, and other tasks run in between, instead
        of one stretch of about 3 ms for 8 ranks.
        """
        assert self._owned is not None
        for rank in ranks:
            if rank.started:
                self._owned.start_soon(self._watch_exit, rank)
                pump = self._live.pump(rank)
                if pump is not None:
                    self._owned.start_soon(pump)
                await checkpoint()

    async def _exit_of(self, rank: RankHandle) -> RankExit | None:
        """Wait until the owner has recorded ``rank``'s exit; None if it never started."""
        while rank not in self._recorded and not self._done.is_set():
            await self._changed.wait()
        return rank.exit

    async def _watch_exit(self, rank: RankHandle) -> None:
        """Wait for one attempt's exit and record it: the one path of an exit."""
        self._record_exit(rank, await rank.wait())

    async def _run_shutdown(self) -> None:
        """Run the shutdown asked for, if any, to the end whatever cancellation comes."""
        shutdown = self._shutdown
        if shutdown is None:
            return
        started = [rank for rank in self._ranks if rank.started]
        faulty = [rank for rank in started if rank in self._faulty]

        async def run() -> list[RankHandle]:
            return await shutdown.run(started, self._watch_exit, at_once=faulty)

        self._stuck += await run_to_completion(run)

    async def _close(self) -> None:
        try:
            for rank in self._ranks:  # seen by the shutdown, or by a poll
                if rank.exit is not None:
                    self._record_exit(rank, rank.exit)
            self._live.release(self._ranks)
            await self._live.aclose()  # the pool of shared memory, freed off the loop
            await self._launcher.aclose()
        finally:
            # Nothing more can come, even from a rank stuck in the kernel.
            self.events.close()
            if self.capture is not None:
                self.capture.close()
            self._done.set()
            self._changed.notify()

    # ------------------------------------------------------------------ exits

    def _record_exit(self, rank: RankHandle, exit: RankExit) -> None:
        """Record one attempt's exit, once, and act on it."""
        if rank in self._recorded:
            return
        self._recorded.add(rank)
        # Its channel ends with it, even if a process it started holds the
        # rank's end open: receivers get what it sent, then the end.
        self._live.release([rank])
        exited = Exited(
            rank=exit.rank,
            pid=exit.pid,
            exit_code=exit.exit_code,
            signal_name=signal_name(exit.exit_code) if exit.exit_code < 0 else None,
            outcome=exit.summary(),
            stopped_by_us=exit.stopped_by_us,
        )
        self._last_exits[exit.rank] = exited
        self.events.append(exited)
        self._exits_seen += 1
        if not exit.stopped_by_us and rank not in self._faulty:
            policy = self._supervision.restart
            if not exit.succeeded or (policy is not None and policy.on == "any"):
                self._failed(exit)
        if exit.rank not in self._tracker.pending_slots():
            self.events.append(Stopped(rank=exit.rank, pid=exit.pid))
        self._close_if_over()
        self._changed.notify()

    def _failed(self, failure: Failure) -> None:
        """Restart as the policy allows, or make ``failure`` the group's root cause."""
        if self._root is not None:
            if self._restart_error is None and ended_before(failure, self._root):
                # Learnt of after the root cause, but it ended first: one poll
                # found both exits, or the first rank took longer to exit.
                self._root = failure
            return
        running = {rank.rank for rank in self._ranks if rank.started and rank not in self._recorded}
        view = GroupView(
            nprocs=len(self._ranks),
            running=frozenset(running),
            restarting=self._restarts.pending,
            shutting_down=self._shutdown is not None,
        )
        if not self._restarts.on_failure(failure, view, self._ranks, self._numbers):
            self._give_up(failure)

    def _give_up(self, failure: Failure) -> None:
        """``failure`` is the group's root cause: the owner shuts the group down."""
        self._root = failure
        self._drop_pending()
        if not self._failure_waits_for_join:
            self._ask_shutdown(None, after_failure=True)
        self._changed.notify()
        if self._block is not None:  # an async with block runs: stop it now
            self._block.cancel()

    def _drop_pending(self) -> None:
        """Cancel the pending restarts: the slots that wait for one are finished."""
        for index in sorted(self._restarts.drop()):
            rank = self._ranks[index]
            if rank in self._recorded:
                self.events.append(Stopped(rank=index, pid=rank.pid))

    def _over(self) -> bool:
        """True once no rank runs and none will be started again."""
        return not self._restarts.pending and all(
            rank in self._recorded
            or (self._started.is_set() and self._starting is None and not rank.started)
            for rank in self._ranks
        )

    def _finished(self) -> bool:
        return self._root is not None or self._shutdown is not None or self._over()

    def _owner_done(self) -> bool:
        """True once the owner has nothing left to do but the shutdown (if one is asked)."""
        return self._shutdown is not None or self._over()

    def _close_if_over(self) -> None:
        """End the events and output iterations once nothing more can come."""
        if self._over():
            self.events.close()
            if self.capture is not None:
                self.capture.close()

    # --------------------------------------------------------------- restarts

    async def _stop_attempts(self, ranks: Sequence[RankHandle]) -> bool:
        """Stop ``ranks`` for a restart, to the end; False if one cannot be reaped."""
        grace = self._supervision.grace_period
        shutdown = Shutdown(grace, wait_first=False, on_signal=self._signalled)
        stuck = await run_to_completion(lambda: shutdown.run(ranks, self._watch_exit))
        self._stuck += stuck
        return not stuck

    async def _start_again(self, slots: Sequence[int]) -> list[RankHandle]:
        """Make and start the next attempt at each of ``slots``."""
        if len(slots) == len(self._ranks):
            self._launcher.new_rendezvous()
        fresh = self._make_ranks(slots, [self._numbers[index] + 1 for index in slots])
        self._live.forget(self._ranks[rank.rank] for rank in fresh)
        for rank in fresh:
            self._faulty.discard(self._ranks[rank.rank])
            self._numbers[rank.rank] += 1
            self._ranks[rank.rank] = rank
        self._starting = starting = anyio.Event()
        try:
            await self._launch(fresh)
        finally:
            self._starting = None
            starting.set()
        return fresh

    def _make_ranks(
        self, slots: Sequence[int], restarts: Sequence[int] | None = None
    ) -> list[RankHandle]:
        """Make (not start) an attempt for each slot; on an error, release those made."""
        made: list[RankHandle] = []
        try:
            for index, restart in zip(slots, restarts or [0] * len(slots), strict=True):
                made.append(self._launcher.make_rank(index, restart))
        except BaseException:
            for rank in made:
                rank.discard()
            raise
        for rank in made:
            self._live.add(rank)
        return made

    def _failed_restart(self, failure: Failure, error: Exception | None) -> None:
        """A restart could not happen: the failure it answered is the group's root cause."""
        if self._root is None:
            self._restart_error = error
            self._give_up(failure)
        self._changed.notify()

    async def _launch(self, ranks: Sequence[RankHandle]) -> None:
        try:
            await self._launcher.start(ranks)
        finally:  # those that started, even when others could not
            for rank in ranks:
                if rank.started:
                    started = Started(
                        rank=rank.rank,
                        pid=rank.pid,
                        restart=self._numbers[rank.rank],
                        time=self._clock(),
                    )
                    self._last_starts[rank.rank] = started
                    self.events.append(started)

    # ------------------------------------------------------------------ hangs

    def _running_attempts(self) -> Iterator[tuple[RankHandle, float, bool]]:
        """The attempts that run, with their start time, and whether we stop them (for hangs)."""
        restarting = self._tracker.pending_slots()
        for rank in self._ranks:
            started = self._last_starts[rank.rank]
            if rank.started and rank not in self._recorded and started is not None:
                # An exit seen but not recorded yet is no hang: its slot may
                # read as never having beaten once the rank is gone.
                over = rank.exit is not None or rank in self._faulty
                yield rank, started.time, over or rank.rank in restarting

    def _hung(self, rank: RankHandle, hang: Hang) -> None:
        if rank in self._recorded or rank.exit is not None or self._shutdown is not None:
            return  # it exited meanwhile, and that exit is reported as any other
        self.events.append(
            Hung(rank=rank.rank, pid=hang.pid, seconds=hang.seconds, stack=hang.stack)
        )
        self._faulted(rank, hang)

    def _faulted(self, rank: RankHandle, failure: Failure) -> None:
        """``rank`` runs, and has failed (hung, or broke its channel): its exit is no cause."""
        self._faulty.add(rank)
        self._failed(failure)
        self._changed.notify()

    # --------------------------------------------------------------- shutdown

    def _signalled(self, rank: RankHandle, signum: int) -> None:
        self.events.append(
            Terminating(rank=rank.rank, pid=rank.pid, signal_name=signal.Signals(signum).name)
        )

    def _error(self) -> BaseException | None:
        """The exception ``join()`` raises once the group has been shut down, if any."""
        if self._broken_owner is not None:
            error = RuntimeError("aiospawn's supervision of this group failed (a defect)")
            error.__cause__ = self._broken_owner
            return error
        # A rank stuck in the kernel may have been released since.
        self._stuck = [rank for rank in self._stuck if rank.poll() is None]
        tracker = self._tracker
        return group_error(
            self._root,
            [rank.exit for rank in self._ranks],
            stuck=[(rank.rank, rank.pid) for rank in self._stuck],
            restarts=tracker.history,
            restart_error=self._restart_error,
            give_up_note=tracker.give_up_note() if tracker.gave_up else None,
        )
