"""A group driven by blocking calls: started, joined and ended through the portal.

``aiospawn.sync``'s ``ProcessContext`` is a thin handle over a
:class:`BlockingGroup`: the group (an ``AsyncProcessContext``), the loop
thread that runs it (``_portal.LoopThread``), and the outcome ``join()``
reports. Each blocking call may be cut short at any point (a Ctrl-C, any
exception in the caller); whatever point it is, :meth:`BlockingGroup.settle`
brings the group to its end from there: every rank stopped and reaped, the
outcome recorded, the loop thread gone. Its stages::

    RUNNING ──────── join() returned True, or raised the group's failure ───┐
       │                                                                    ▼
       ├── settle(): a shutdown, waited for ─── recorded on the loop ──► RECORDED
       │                                                                    │
       └── settle() cut short by a second Ctrl-C ──► CONCLUDING             │
              (the loop thread finishes the shutdown, hurried to a          │
               SIGKILL, records it, and ends; the next join() or            │
               terminate() waits for it)                                    │
                                                                            ▼
                               the loop thread has ended, the ranks read ► FINISHED

The group is reached through three calls of its supervisor
(``group_of(group)``): ``wait_step()``, ``join()`` and ``unjoined()``.

Imports the standard library, anyio (through the portal), ``aiospawn._core``,
``aiospawn._api`` (the async start) and the portal.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from aiospawn import _torch_errors
from aiospawn._api import start_processes as _start_group_async
from aiospawn._core._context import AsyncProcessContext, group_of
from aiospawn._core._errors import ProcessException
from aiospawn._core._group import stop_on_join
from aiospawn._core._log import log_as

from ._interrupts import CtrlC
from ._portal import LoopClosed, LoopThread

# The logger of torch's spawn module, where its shutdown warnings go; logging
# set up for torch (its test suite's assertLogs() too) listens there.
_TORCH_LOGGER = "torch.multiprocessing.spawn"


class Stage(enum.Enum):
    """How far a :class:`BlockingGroup` is on its way to its end."""

    #: The loop thread runs the group; how it ends is not known yet.
    RUNNING = "running"
    #: A call cut short left the shutdown to the loop thread, which records
    #: the outcome; the next call waits for it.
    CONCLUDING = "concluding"
    #: How the group ended is known (``error``); the loop thread may still run.
    RECORDED = "recorded"
    #: The loop thread has ended: nothing changes any more.
    FINISHED = "finished"


class BlockingGroup:
    """A started group on its loop thread, and what ``join()`` reports about it.

    Attributes:
        group: The group.
        processes: The ranks' ``multiprocessing`` process objects.
        unjoined: The ranks whose exit ``join()`` has not reported yet.
        error: How the group failed, once the stage is ``RECORDED`` or
            ``FINISHED``; None if it did not.
    """

    def __init__(self, group: AsyncProcessContext[Any], loop: LoopThread) -> None:
        self.group = group
        self._loop = loop
        self._lock = threading.Lock()  # one join() at a time
        # Written by the caller and, in _conclude, by the loop thread; a
        # caller's write may overwrite RECORDED with RUNNING or CONCLUDING.
        # That only makes a later settle() ask the loop again (which finds it
        # closed, or the shutdown done): the outcome itself is in `error`,
        # written by whoever records it, before the stage says so.
        self._stage = Stage.RUNNING
        self.error: ProcessException | None = None
        self.processes: list[Any] = group.processes
        self.unjoined: list[int] = list(range(len(group.processes)))

    @property
    def stage(self) -> Stage:
        """Where the group is on its way to its end."""
        return self._stage

    def pids(self) -> list[int]:
        """The ranks' process ids, index = rank."""
        return self.group.pids()

    def join(self, timeout: float | None, grace_period: float | None) -> bool:
        """``ProcessContext.join()``: wait for one exit, or for ``timeout``."""
        with self._lock:
            self._wait_again()
            return self._join(timeout, grace_period, until_all=False)

    def join_all(self) -> None:
        """Wait for every rank, as ``start_processes(join=True)`` does."""
        with self._lock:
            self._join(None, None, until_all=True)

    def terminate(self, grace_period: float | None) -> None:
        """``ProcessContext.terminate()``: shut the group down, reap it, end the loop thread."""
        # Not under the lock: a join() blocked in another thread holds it,
        # and must see this shutdown (it then raises) rather than wait.
        with contextlib.suppress(LoopClosed):
            self._loop.run(self.group.terminate, grace_period)
        with self._lock:
            self._wait_again()
            self.settle(grace_period)

    def _wait_again(self) -> None:
        # A new call waits for a shutdown that a call cut short left to the loop.
        if self._stage is Stage.CONCLUDING:
            self._stage = Stage.RUNNING

    def _join(self, timeout: float | None, grace_period: float | None, *, until_all: bool) -> bool:
        if self._stage is Stage.FINISHED:
            return self._replay()
        # Two levels: an exception anywhere in the inner handler or after it
        # (the caller interrupted while the outcome is being recorded) must
        # still reach the outer one.
        try:
            try:
                done, self.unjoined = self._loop.run(
                    _join_step, self.group, timeout, grace_period, until_all
                )
            except LoopClosed:  # concluded by an interrupted call, which ended the loop
                self.settle(grace_period)
                return self._replay()
            except ProcessException as error:  # the group failed and has been shut down
                self._record(error)
                raise
            if done:
                self._record(None)
        except BaseException:
            # Interrupted, or failed: the group has been shut down (a
            # cancelled join shuts it down); record how it ended if that is
            # not done yet, and end the loop thread.
            self.settle(grace_period)
            raise
        return done

    def _record(self, error: ProcessException | None) -> None:
        """Record the outcome join() reports from now on, and end the loop thread."""
        self.error = error
        self._stage = Stage.RECORDED
        self.settle(None)

    def settle(self, grace_period: float | None) -> None:
        """Bring the group to its end from whatever state an interruption left it in.

        Terminates what still runs and records the outcome (unless that is
        done), ends the loop thread, then reads the group's final state.
        Idempotent. If the shutdown's wait is itself interrupted (a second
        Ctrl-C), the exception propagates at once, the shutdown is hurried
        (SIGKILL now, not after the grace period) and a later call does not
        wait again: the loop thread completes the shutdown by itself and the
        next join() reports it.
        """
        if self._stage is Stage.FINISHED:
            return
        if self._stage is not Stage.RECORDED:
            if self._stage is Stage.CONCLUDING:
                return
            self._stage = Stage.CONCLUDING
            # The loop thread records the outcome and then ends, even if this
            # wait is interrupted and nobody waits for it any more.
            ctrl_c = CtrlC.current()
            if ctrl_c is not None and ctrl_c.count > 1:  # a second Ctrl-C: out at once
                self._loop.start(self._conclude, 0)
                return
            try:
                with contextlib.suppress(LoopClosed):  # recorded by a concurrent call
                    self._loop.run(
                        self._conclude, grace_period, interruptible=False, then_stop=True
                    )
            except KeyboardInterrupt:
                # A second Ctrl-C while the ranks are given their grace period:
                # out at once, and the ranks are killed now, not after it.
                self._loop.start(self.group.terminate, 0)
                raise
        self._loop.close()
        # The loop thread has ended: the group's state is ours to read.
        self.unjoined = group_of(self.group).unjoined()
        self._stage = Stage.FINISHED

    async def _conclude(self, grace_period: float | None) -> None:
        self.error = await _terminate_and_report(self.group, grace_period)
        self._stage = Stage.RECORDED

    def _replay(self) -> bool:
        if self.error is None:
            return True
        raise _fresh(self.error)


def start(
    fn: Callable[..., object],
    args: Sequence[Any],
    nprocs: int,
    join: bool,
    daemon: bool,
    start_method: str | None,
) -> BlockingGroup:
    """Start a group on a new loop thread (and join it); if interrupted, stop what started.

    Returns:
        The group: over with ``join``, else running.

    Raises:
        Whatever the start or the join raised, once every rank that started
        has been reaped and the loop thread has ended.
    """
    # The loop thread's context, inherited by every task and worker thread
    # of its group: the group's events are logged where torch's are.
    loop = LoopThread(prepare=_stand_in_for_torch)
    # Filled on the loop thread as soon as the group exists, so that an
    # interruption at any point after that still finds it.
    started: list[AsyncProcessContext[Any]] = []
    blocking: BlockingGroup | None = None
    # One try from the start to the end of the join: whatever point is hit,
    # the handler finds every rank that started.
    try:
        loop.run(_start_group, started, fn, args, nprocs, daemon, start_method)
        blocking = BlockingGroup(started[0], loop)
        if join:
            blocking.join_all()
    except BaseException:
        if blocking is not None:
            blocking.settle(None)
        else:
            if started:  # the start finished as the caller was interrupted
                with contextlib.suppress(LoopClosed):
                    loop.run(started[0].terminate, interruptible=False, then_stop=True)
            loop.close()
        raise
    return blocking


def _stand_in_for_torch() -> None:
    """The loop thread's context, inherited by every task and worker thread of its group."""
    log_as(_TORCH_LOGGER)  # the group's events are logged where torch's are
    stop_on_join()  # and a failure stops the group in join(), as torch's does


async def _start_group(
    started: list[AsyncProcessContext[Any]],
    fn: Callable[..., object],
    args: Sequence[Any],
    nprocs: int,
    daemon: bool,
    start_method: str | None,
) -> None:
    # Through the async API's Sequence-typed path; its overloads want a tuple.
    start_group = cast("Callable[..., Awaitable[AsyncProcessContext[Any]]]", _start_group_async)
    group = await start_group(
        fn, args, nprocs, join=False, daemon=daemon, start_method=start_method
    )
    # No checkpoint between the start's end and this: a cancellation cannot
    # come in between and lose the group.
    started.append(group)


async def _join_step(
    group: AsyncProcessContext[Any],
    seconds: float | None,
    grace_period: float | None,
    until_all: bool,
) -> tuple[bool, list[int]]:
    supervisor = group_of(group)
    try:
        if until_all:
            done = await supervisor.join(seconds, grace_period)
        else:
            done = await supervisor.wait_step(seconds, grace_period)
    except ProcessException as error:
        twin = _torch_errors.for_torch(error)  # torch's class too, for torch's except clauses
        if twin is error:
            raise
        raise twin from error.__cause__
    return done, supervisor.unjoined()


async def _terminate_and_report(
    group: AsyncProcessContext[Any], grace_period: float | None
) -> ProcessException | None:
    """Shut the group down (a no-op once it is over) and return what join() reports."""
    await group.terminate(grace_period)
    try:
        await group.join(0)
    except ProcessException as error:
        return _torch_errors.for_torch(error)
    return None


def _fresh(error: ProcessException) -> ProcessException:
    """An equal exception for a repeated ``join()``, without the first one's traceback."""
    clone = copy.copy(error)
    clone.__cause__ = error.__cause__
    if hasattr(error, "__notes__"):
        clone.__notes__ = list(error.__notes__)
    return clone
