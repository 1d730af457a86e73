"""A blocking drop-in for ``torch.multiprocessing.spawn``, built on the async core.

(About 1,000 lines: half are torch's call signatures, with their overloads, and
the docstrings that keep torch's contract; the rest is one idea, the
blocking hand-off to a private event loop that no interruption of the caller
can strand.)

Change one import and keep the calls, the messages and the exceptions::

    import aiospawn.sync as mp  # was: import torch.multiprocessing as mp

    mp.spawn(train, args=(world_size,), nprocs=world_size)

Each group gets its own event loop on a private daemon thread; the blocking
calls hand it coroutine functions to run (:class:`_LoopThread`). The loop
thread, not the caller, owns the ranks, so they outlive the thread that
started them, and they die with the process (the core's parent guard watches
the process, not a thread)::

    caller thread                          loop thread "aiospawn-sync-loop" (daemon)
    ─────────────                          ─────────────────────────────────────────
    start_processes() ──── a _Call ──────► AsyncProcessContext._start()
    ProcessContext.join() ─ a _Call ─────► its group's wait_step() (see _core._group)
        │ sleeps on its own latch in        │
        │ 50 ms steps, so that a signal's   │
        │ handler always gets to run        │
        │ Ctrl-C (counted, not raised),     │
        └ or any exception: cancel ───────► └ cancelled: SIGTERM, grace, SIGKILL, reap
      KeyboardInterrupt raised here   ◄──── the call ends
    joined (True), raised or terminated ─► the loop thread ends; the caller waits for that

The caller never blocks inside ``threading``'s or ``concurrent.futures``'
waits, where a ``KeyboardInterrupt`` can leave a lock held or a thread marked
stopped: an interruption at any point of the caller still ends with every
rank reaped and the loop thread gone.

What this module keeps from torch: the names in ``__all__`` (plus
``ENV_VAR_PARALLEL_START``, the name of torch's environment variable for
parallel starts, which aiospawn does not need: its starts are always
concurrent), ``fn(rank, *args)``, ``join()`` returning False after each clean
exit while ranks remain, the shutdown escalation and its WARNING logs (on
torch's logger, ``torch.multiprocessing.spawn``), and the exception messages.
What it fixes: see the README. The rest of ``torch.multiprocessing``'s names
(``multiprocessing``'s, and torch's sharing strategies) are found on first use
by the module's ``__getattr__`` (``aiospawn._torch_mp``), which imports torch
only for a name of torch's own.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import copy
import inspect
import signal
import sys
import threading
import types
import warnings
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, TypeVarTuple, cast, overload

import anyio

from . import _torch_errors, _torch_mp
from ._api import start_processes as _start_group_async
from ._api import warn_spawn_only
from ._core._context import AsyncProcessContext, group_of
from ._core._errors import ProcessException, ProcessExitedException, ProcessRaisedException
from ._core._log import log_as
from ._core._spec import check_seconds, resolve_start_method

__all__ = [
    "ENV_VAR_PARALLEL_START",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]

if TYPE_CHECKING:
    # The stand-in's names for the checker: found by __getattr__ at run time.
    from multiprocessing import *  # noqa: F403

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: The environment variable torch reads to start ``forkserver`` ranks in
#: parallel. Kept for compatibility only: aiospawn starts ranks concurrently
#: under every start method where that is safe, whatever it says.
ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"

_LOOP_THREAD_NAME = "aiospawn-sync-loop"

# The logger of torch's spawn module, where its shutdown warnings go; logging
# set up for torch (its test suite's assertLogs() too) listens there.
_TORCH_LOGGER = "torch.multiprocessing.spawn"


class ProcessContext:
    """A started group of ranks, driven by blocking calls; torch's ``ProcessContext``.

    Made by ``start_processes(..., join=False)`` and ``spawn(..., join=False)``.
    Constructed directly (no arguments) it is an empty group, whose ``join()``
    returns True at once, like torch's ``ProcessContext([], [])``.

    Each context runs its group on a private event loop thread, which ends as
    soon as the group is over: ``join()`` returned True or raised, or
    :meth:`terminate` returned.

    Attributes:
        processes: The ``multiprocessing`` process objects, index = rank.
        error_files: One empty string per rank. torch passes tracebacks through
            pickle files at these paths; aiospawn never writes such files (a
            rank's outcome comes back on a private pipe), and the list is kept
            only so that code indexing it keeps working.
        sentinels: ``{process.sentinel: rank}`` for the ranks whose exit has
            not been seen yet by ``join()``, as in torch. Read it; never wait
            on these fds yourself.
    """

    def __init__(
        self,
        _group: AsyncProcessContext[Any] | None = None,
        _loop: _LoopThread | None = None,
    ) -> None:
        self._group = _group
        self._loop = _loop
        self._lock = threading.Lock()
        self._finished = _group is None
        self._recorded = _group is None  # the outcome join() reports is known
        self._concluding = False
        self._error: ProcessException | None = None
        self.processes: list[Any] = [] if _group is None else _group.processes
        self.error_files: list[str] = [""] * len(self.processes)
        self.sentinels: dict[int, int] = {
            process.sentinel: rank for rank, process in enumerate(self.processes)
        }

    def pids(self) -> list[int]:
        """Return the ranks' process ids, index = rank.

        Returns:
            One pid per rank.
        """
        return [] if self._group is None else self._group.pids()

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for a rank to exit; on the first failure, stop the others and raise.

        torch's semantics: returns False as soon as a rank has exited cleanly
        while others still run (so ``while not ctx.join(): pass`` waits for
        all of them), or when ``timeout`` passes; True once every rank has
        exited cleanly, and again on every later call. When a rank fails, the
        others are shut down: if ``grace_period`` is set they first get that
        long to exit by themselves (nothing is logged if they do); then the
        survivors get SIGTERM, logged as a WARNING ``"Terminating process
        {pid} via signal SIGTERM"`` on torch's logger,
        ``torch.multiprocessing.spawn`` (and to the handlers of the
        ``aiospawn`` logger), then 30 s
        (``grace_period`` if set), then SIGKILL, logged too. Every rank has
        been reaped when the exception is raised. Later calls raise an equal
        exception (torch raises one for another rank each time).

        Args:
            timeout: Seconds to wait for an exit; ``None`` waits as long as it
                takes, and ``0`` or a negative value checks without waiting.
            grace_period: After a failure, seconds the other ranks may take to
                exit by themselves before SIGTERM, and between SIGTERM and
                SIGKILL. ``None``: SIGTERM at once, SIGKILL 30 s later.

        Returns:
            True once every rank has exited cleanly, else False.

        Raises:
            ProcessRaisedException: A rank's ``fn`` raised (a rank interrupted
                by ``KeyboardInterrupt`` or SIGINT included).
            ProcessExitedException: A rank exited with a non-zero code or was
                killed by a signal, or the group was terminated.
            ProcessException: A rank did not exit even after SIGKILL (it is
                stuck in the kernel); raised once the bounded wait for it ends.
            ValueError: ``timeout`` is not a number or ``grace_period`` is
                negative.
            RuntimeError: Called from a thread running an asyncio or trio
                event loop; use ``await aiospawn.start_processes(...)`` there.

        Ctrl-C while it waits shuts the group down as a failure does, and
        ``KeyboardInterrupt`` is raised once every rank has been reaped. In
        the main thread, while SIGINT has Python's default handler, this call
        puts its own in place (as ``asyncio.run`` does): the first Ctrl-C is
        raised at that one point, never in the middle of the call's own
        bookkeeping. Any other exception raised in the calling thread while it
        waits does the same. A second Ctrl-C during the shutdown propagates at
        once; the loop thread finishes the shutdown and the next ``join()``
        reports it.
        """
        _refuse_inside_event_loop("ProcessContext.join()")
        wait = _timeout_seconds(timeout)
        check_seconds("grace_period", grace_period)
        return _with_ctrl_c_deferred(lambda: self._locked_join(wait, grace_period))

    def terminate(self, grace_period: float | None = None) -> None:
        """Shut every running rank down (SIGTERM, grace period, SIGKILL) and reap it.

        An aiospawn addition; torch's ``ProcessContext`` has no such method.
        Idempotent, and safe to call from another thread while one is blocked
        in :meth:`join`, which then raises. A later :meth:`join` raises
        :class:`ProcessExitedException` for the lowest rank this stopped, or
        returns True if every rank had already exited cleanly.

        Args:
            grace_period: Seconds between SIGTERM and SIGKILL; ``None`` means 30 s.

        Raises:
            ValueError: ``grace_period`` is negative.
            RuntimeError: Called from a thread running an asyncio or trio
                event loop.
        """
        _refuse_inside_event_loop("ProcessContext.terminate()")
        check_seconds("grace_period", grace_period)
        _with_ctrl_c_deferred(lambda: self._terminate(grace_period))

    def __repr__(self) -> str:
        state = f"unjoined={len(self.sentinels)}"
        if self._error is not None:
            state += f" failed=rank {self._error.error_index}"
        return f"<{type(self).__name__} nprocs={len(self.processes)} {state}>"

    def _locked_join(self, timeout: float | None, grace_period: float | None) -> bool:
        with self._lock:
            self._concluding = False  # a new call may wait for the shutdown again
            return self._join(timeout, grace_period, until_all=False)

    def _terminate(self, grace_period: float | None) -> None:
        loop, group = self._loop, self._group
        if loop is not None and group is not None:
            # Not under the lock: a join() blocked in another thread holds it,
            # and must see this shutdown (it then raises) rather than wait.
            with contextlib.suppress(_LoopClosed):
                loop.run(group.terminate, grace_period)
        with self._lock:
            self._concluding = False
            self._settle(grace_period)

    def _join(self, timeout: float | None, grace_period: float | None, *, until_all: bool) -> bool:
        if self._finished:
            return self._replay()
        loop, group = self._loop, self._group
        assert loop is not None
        assert group is not None
        # Two levels: an exception anywhere in the inner handler or after it
        # (the caller interrupted while the outcome is being recorded) must
        # still reach the outer one.
        try:
            try:
                done, unjoined = loop.run(_join_step, group, timeout, grace_period, until_all)
            except _LoopClosed:  # concluded by an interrupted call, which ended the loop
                self._settle(grace_period)
                return self._replay()
            except ProcessException as error:  # the group failed and has been shut down
                self._record(error)
                raise
            self.sentinels = {self.processes[rank].sentinel: rank for rank in unjoined}
            if done:
                self._record(None)
        except BaseException:
            # Interrupted, or failed: the group has been shut down (a
            # cancelled join shuts it down); record how it ended if that is
            # not done yet, and end the loop thread.
            self._settle(grace_period)
            raise
        return done

    def _record(self, error: ProcessException | None) -> None:
        """Record the outcome join() reports from now on, and end the loop thread."""
        self._error = error
        self._recorded = True
        self._settle(None)

    def _settle(self, grace_period: float | None) -> None:
        """Bring the group to its end from whatever state an interruption left it in.

        Terminates what still runs and records the outcome (unless that is
        done), ends the loop thread, then reads the group's final state.
        Idempotent. If the shutdown's wait is itself interrupted (a second
        Ctrl-C), the exception propagates at once and a later call does not
        wait again: the loop thread completes the shutdown by itself and the
        next join() reports it.
        """
        if self._finished:
            return
        loop, group = self._loop, self._group
        assert loop is not None
        assert group is not None
        if not self._recorded:
            if self._concluding:
                return
            self._concluding = True
            # The loop thread records the outcome and then ends, even if this
            # wait is interrupted and nobody waits for it any more.
            ctrl_c = _CtrlC.current()
            if ctrl_c is not None and ctrl_c.count > 1:  # a second Ctrl-C: out at once
                loop.start(self._conclude, grace_period)
                return
            with contextlib.suppress(_LoopClosed):  # recorded by a concurrent call
                loop.run(self._conclude, grace_period, interruptible=False, then_stop=True)
        loop.close()
        # The loop thread has ended: the group's state is ours to read.
        self.sentinels = {
            self.processes[rank].sentinel: rank for rank in group_of(group).unjoined()
        }
        self._finished = True

    async def _conclude(self, grace_period: float | None) -> None:
        assert self._group is not None
        error = await _terminate_and_report(self._group, grace_period)
        self._error = error
        self._recorded = True

    def _replay(self) -> bool:
        if self._error is None:
            return True
        raise _fresh(self._error)


class SpawnContext(ProcessContext):
    """Deprecated alias of :class:`ProcessContext`, kept because torch keeps it.

    Constructing one warns, in torch's words, with a :class:`UserWarning`.
    """

    def __init__(
        self,
        _group: AsyncProcessContext[Any] | None = None,
        _loop: _LoopThread | None = None,
    ) -> None:
        warnings.warn(
            "SpawnContext is renamed to ProcessContext since 1.4 release.",
            UserWarning,
            stacklevel=2,
        )
        super().__init__(_group, _loop)


@overload
def start_processes(
    fn: Callable[[int, *Ts], object],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    join: Literal[True] = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> None: ...


@overload
def start_processes(
    fn: Callable[[int, *Ts], object],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext: ...


@overload
def start_processes(
    fn: Callable[[int, *Ts], object],
    args: tuple[*Ts],
    nprocs: int,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext: ...


@overload
def start_processes(
    fn: Callable[..., object],
    args: Sequence[Any] = ...,
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext | None: ...


def start_processes(
    fn: Callable[..., object],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext | None:
    """Start ``nprocs`` processes running ``fn(rank, *args)``; torch's ``start_processes``.

    The ranks start concurrently (under ``fork``, one after the other on one
    thread), so N ranks with a large ``args`` or a slow import take about one
    rank's start time; ``TORCH_MP_PARALLEL_START`` is not consulted. Each rank
    leads its own process group and dies with it when this process exits,
    however it exits.

    Args:
        fn: A function taking the rank first. Under ``spawn`` and
            ``forkserver`` it must be importable by the rank (a module-level
            function).
        args: Further positional arguments for ``fn``.
        nprocs: How many ranks. ``0`` starts nothing, as in torch.
        join: Wait for every rank (True) or return the :class:`ProcessContext`
            at once (False).
        daemon: Start the processes as daemons (they cannot have children).
        start_method: ``"spawn"``, ``"fork"``, ``"forkserver"``, or ``None``
            for the platform default.

    Returns:
        ``None`` with ``join=True``, as torch returns; the group's
        :class:`ProcessContext` with ``join=False``.

    Raises:
        ProcessRaisedException: A rank's ``fn`` raised (``join=True``).
        ProcessExitedException: A rank exited with a non-zero code or was
            killed by a signal (``join=True``).
        TypeError: ``fn`` is not callable or cannot reach the ranks; ``args``
            is not a sequence. Raised before any process starts.
        ValueError: ``nprocs`` is negative or too large, or ``start_method``
            is unknown. Raised before any process starts.
        Exception: A rank could not be started (``args`` that cannot be
            pickled, a process limit); the ranks already started have been
            stopped and reaped first, and a note names the rank.
        RuntimeError: Called from a thread running an asyncio or trio event
            loop, which this call would block; use ``await
            aiospawn.start_processes(...)`` or ``aiospawn.open_group(...)``.
            A synchronous notebook cell is allowed, though ipykernel runs it
            inside its loop.

    Ctrl-C (or any exception raised in the calling thread) while it waits
    stops every rank (SIGTERM, 30 s, SIGKILL) and reaps it before
    ``KeyboardInterrupt`` propagates, as :meth:`ProcessContext.join` says.
    """
    _refuse_inside_event_loop("start_processes()")
    return _start_processes(fn, args, nprocs, join, daemon, start_method)


def _start_processes(
    fn: Callable[..., object],
    args: Sequence[Any],
    nprocs: int,
    join: bool,
    daemon: bool,
    start_method: str | None,
) -> ProcessContext | None:
    if isinstance(nprocs, int) and not isinstance(nprocs, bool) and nprocs == 0:
        # torch starts nothing and joins at once; the core wants a positive nprocs.
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        resolve_start_method(start_method)
        return None if join else ProcessContext()
    return _with_ctrl_c_deferred(
        lambda: _start_and_join(fn, args, nprocs, join, daemon, start_method)
    )


def _start_and_join(
    fn: Callable[..., object],
    args: Sequence[Any],
    nprocs: int,
    join: bool,
    daemon: bool,
    start_method: str | None,
) -> ProcessContext | None:
    """Start a group on a new loop thread (and join it); if interrupted, stop what started."""
    loop = _LoopThread()
    # Filled on the loop thread as soon as the group exists, so that an
    # interruption at any point after that still finds it.
    started: list[AsyncProcessContext[Any]] = []
    context: ProcessContext | None = None
    # One try from the start to the end of the join: whatever point is hit,
    # the handler finds every rank that started.
    try:
        loop.run(_start_group, started, fn, args, nprocs, daemon, start_method)
        context = ProcessContext(started[0], loop)
        if join:
            with context._lock:
                context._join(None, None, until_all=True)
    except BaseException:
        if context is not None:
            context._settle(None)
        else:
            if started:  # the start finished as the caller was interrupted
                with contextlib.suppress(_LoopClosed):
                    loop.run(started[0].terminate, interruptible=False, then_stop=True)
            loop.close()
        raise
    return None if join else context


@overload
def spawn(
    fn: Callable[[int, *Ts], object],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    join: Literal[True] = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> None: ...


@overload
def spawn(
    fn: Callable[[int, *Ts], object],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext: ...


@overload
def spawn(
    fn: Callable[[int, *Ts], object],
    args: tuple[*Ts],
    nprocs: int,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext: ...


@overload
def spawn(
    fn: Callable[..., object],
    args: Sequence[Any] = ...,
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext | None: ...


def spawn(
    fn: Callable[..., object],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
) -> ProcessContext | None:
    """:func:`start_processes` with the ``spawn`` start method; torch's ``spawn``.

    Args:
        fn: As for :func:`start_processes`.
        args: As for :func:`start_processes`.
        nprocs: As for :func:`start_processes`.
        join: As for :func:`start_processes`.
        daemon: As for :func:`start_processes`.
        start_method: Ignored unless ``"spawn"``: any other value is replaced
            by ``"spawn"`` with a :class:`FutureWarning`, as torch does.

    Returns:
        As for :func:`start_processes`.

    Raises:
        ProcessRaisedException, ProcessExitedException, TypeError, ValueError,
        RuntimeError: As for :func:`start_processes`.
    """
    _refuse_inside_event_loop("spawn()")
    if start_method != "spawn":
        warn_spawn_only(start_method, "aiospawn.sync.start_processes")
    return _start_processes(fn, args, nprocs, join, daemon, "spawn")


class _LoopClosed(Exception):
    """The group is over and its loop thread has ended (by another thread's call)."""


#: How long a blocked caller sleeps at a time. CPython runs a signal handler
#: in the main thread only between bytecodes or when a wait returns EINTR; a
#: signal that lands just before the thread goes to sleep only sets a flag, so
#: an unbounded sleep could outlast a Ctrl-C for as long as the ranks run.
_POLL_SECONDS = 0.05


class _Latch:
    """A flag set once by one thread and waited for by another, in short sleeps.

    Neither side ever blocks inside ``threading``'s Condition or Event code,
    where an exception (a Ctrl-C in the waiter) can leave a lock held, and
    ``set()`` never blocks at all.
    """

    __slots__ = ("_lock", "is_set")

    def __init__(self) -> None:
        self.is_set = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        if not self.is_set:
            self.is_set = True
            self._lock.release()

    def wait(self, poll: Callable[[], object] | None = None) -> None:
        # The flag, not the lock, says whether it is set: an exception right
        # after a successful acquire must not make the next wait sleep forever.
        while not self.is_set:
            if poll is not None:
                poll()
            self._lock.acquire(timeout=_POLL_SECONDS)


class _Call:
    """One coroutine function run on the loop thread for a blocking caller."""

    __slots__ = ("args", "begun", "cancel", "done", "error", "fn", "result", "scope")

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.begun = False  # loop thread: a task runs it
        self.cancel = False  # caller: stop it
        self.scope: anyio.CancelScope | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = _Latch()

    def finish(self, result: Any, error: BaseException | None) -> None:
        if not self.done.is_set:
            self.result, self.error = result, error
            self.done.set()


class _CtrlC:
    """SIGINT's handler while a blocking call runs in the main thread (asyncio.Runner's way).

    A ``KeyboardInterrupt`` raised wherever the main thread happens to be (in
    ``threading`` internals, half-way through recording a group) can leave a
    lock held or ranks running. Instead, the first Ctrl-C is only counted: the
    wait in progress cancels the call on the loop (the core then shuts the
    group down and reaps it) and raises ``KeyboardInterrupt`` once the call
    has ended. A second Ctrl-C raises at once.
    """

    def __init__(self) -> None:
        self.count = 0
        self.delivered = False

    @property
    def pending(self) -> bool:
        """A Ctrl-C came and has not been raised yet."""
        return self.count > 0 and not self.delivered

    @staticmethod
    def current() -> _CtrlC | None:
        """The handler of the call in progress, if this thread is the main one."""
        if threading.current_thread() is not threading.main_thread():
            return None
        handler = signal.getsignal(signal.SIGINT)
        return handler if isinstance(handler, _CtrlC) else None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1 and _inside_deferring_call(frame):
            return
        if not _inside_deferring_call(frame):
            # Left installed by a call that was cut short before it could put
            # Python's handler back (only another exception can do that).
            signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt


def _with_ctrl_c_deferred(body: Callable[[], T]) -> T:
    """Run ``body()``; in the main thread, with Ctrl-C deferred as :class:`_CtrlC` says.

    Only when SIGINT has Python's default handler: one the program installed
    itself is left alone.
    """
    ctrl_c = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if handler is signal.default_int_handler or isinstance(handler, _CtrlC):
            ctrl_c = _CtrlC()
    try:
        if ctrl_c is not None:
            signal.signal(signal.SIGINT, ctrl_c)
        result = body()
    finally:
        if ctrl_c is not None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if ctrl_c is not None and ctrl_c.pending:
        raise KeyboardInterrupt  # it came after the last wait: as if just after the return
    return result


def _inside_deferring_call(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code is _with_ctrl_c_deferred.__code__:
            return True
        frame = frame.f_back
    return False


class _LoopThread:
    """An asyncio event loop on a private daemon thread, and the calls it runs for callers.

    Not ``anyio.from_thread.start_blocking_portal``: its thread belongs to a
    ``ThreadPoolExecutor``, which the interpreter joins at exit, so a group
    left running would hang the exit; and its hand-offs wait inside
    ``concurrent.futures.Future``, whose Condition an exception in the caller
    can leave locked. Here a caller only ever adds a call to a set, pokes the
    loop with ``call_soon_threadsafe`` (which never blocks) and sleeps on its
    own :class:`_Latch`; whatever point an exception hits in the caller, the
    loop thread can still finish every call and end.

    The thread starts with the first call. A raw ``_thread`` starts it and
    then waits for its end: ``Thread.start()`` and ``Thread.join()`` wait in
    ``threading`` internals that an exception in the caller can break (a lock
    left held, or a live thread marked stopped, bpo-45274), so the caller
    does neither. If the loop thread dies, every call still waiting finishes
    with the reason, and nobody waits forever.
    """

    def __init__(self) -> None:
        self._calls: set[_Call] = set()  # submitted and not finished
        self._spawned = 0  # the starter's thread id, once it runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nudged: asyncio.Event | None = None
        self._stopping = False  # close() was called: end once the calls are done
        self._closing = False  # the loop takes no more calls
        self._ended = _Latch()  # the loop thread has gone
        self._failure: BaseException | None = None

    def run(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        interruptible: bool = True,
        then_stop: bool = False,
    ) -> T:
        """Run ``fn(*args)`` on the loop and wait for its result.

        If the wait is interrupted (an exception in this thread, or with
        ``interruptible`` a first Ctrl-C), ``fn`` is cancelled and the
        exception (``KeyboardInterrupt`` for a Ctrl-C) propagates once ``fn``
        has ended: the core's cancellation shuts the group down and reaps it
        first. ``interruptible=False`` is for calls that clean up after one.
        With ``then_stop`` the loop thread ends after this call (see :meth:`close`).
        """
        call = _Call(fn, args)
        ctrl_c = _CtrlC.current() if interruptible else None

        def on_ctrl_c() -> None:
            if ctrl_c is not None and ctrl_c.pending and not call.cancel:
                self._cancel(call)

        try:
            self._submit(call)
            if then_stop:  # only now: the loop cannot stop before it has seen the call
                self._stopping = True
            call.done.wait(on_ctrl_c)
        except BaseException:
            # The first interruption cancels the call and waits for its end
            # (the group shut down and reaped). A further one (a second
            # Ctrl-C), or one during a clean-up call, propagates at once and
            # leaves the call to finish on the loop.
            if interruptible and not call.cancel:
                self._cancel(call)
                call.done.wait()
            raise
        if ctrl_c is not None and ctrl_c.pending:
            ctrl_c.delivered = True
            raise KeyboardInterrupt
        if call.error is not None:
            raise call.error
        return cast("T", call.result)

    def start(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop without waiting; the loop thread then ends."""
        self._submit(_Call(fn, args))
        self._stopping = True  # after the submission, as in run()

    def close(self) -> None:
        """End the loop once its calls have finished, and wait until its thread has gone."""
        self._stopping = True
        if not self._spawned:
            self._closing = True
            return
        self._nudge()
        self._ended.wait()

    def _submit(self, call: _Call) -> None:
        self._calls.add(call)
        # Added before the check: the loop thread sets _closing before its
        # last look at the calls, so either it finishes this one, or we see
        # the flag.
        if self._closing:
            call.finish(None, _LoopClosed())
            self._calls.discard(call)
            return
        if not self._spawned:
            self._spawned = _thread.start_new_thread(self._start_and_wait, ())
        else:
            self._nudge()

    def _cancel(self, call: _Call) -> None:
        call.cancel = True
        # A call leaves the set only once finished, so one that is not in it
        # was never submitted (the caller was interrupted first).
        if not self._spawned or call not in self._calls:  # no loop thread will look at it
            call.finish(None, None)
            self._calls.discard(call)
        else:
            self._nudge()

    def _nudge(self) -> None:
        # Before the loop runs, there is nothing to poke: it looks at the
        # calls as soon as it does (it publishes itself first).
        loop, nudged = self._loop, self._nudged
        if loop is not None and nudged is not None:
            with contextlib.suppress(RuntimeError):  # closed: _start_and_wait finishes the calls
                loop.call_soon_threadsafe(nudged.set)

    def _start_and_wait(self) -> None:
        """The starter thread: start the loop thread, wait for its end, finish what is left."""
        try:
            thread = threading.Thread(target=self._main, name=_LOOP_THREAD_NAME, daemon=True)
            thread.start()
            thread.join()
        except BaseException as exc:  # pragma: no cover - no thread could be started
            self._failure = exc
        finally:
            self._closing = True
            for call in list(self._calls):
                error = _LoopClosed() if self._stopping else _loop_died(self._failure)
                call.finish(None, error)
                self._calls.discard(call)
            self._ended.set()

    def _main(self) -> None:
        # The loop thread's context, inherited by every task and worker thread
        # of its group: the group's events are logged where torch's are.
        log_as(_TORCH_LOGGER)
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:
            self._failure = exc
        finally:
            self._closing = True

    async def _serve(self) -> None:
        nudged = asyncio.Event()
        async with anyio.create_task_group() as tasks:
            self._nudged = nudged
            self._loop = asyncio.get_running_loop()
            while True:
                for call in list(self._calls):
                    if call.done.is_set:  # cancelled before this thread began
                        self._calls.discard(call)
                    elif not call.begun:
                        call.begun = True
                        tasks.start_soon(self._execute, call)
                    elif call.cancel and call.scope is not None:
                        call.scope.cancel()
                if self._stopping and not self._calls:
                    break
                await nudged.wait()
                nudged.clear()

    async def _execute(self, call: _Call) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                call.scope = scope
                if call.cancel:
                    scope.cancel()
                result = await call.fn(*call.args)
        except BaseException as exc:  # the caller's to raise; never the loop's
            error = exc
        finally:
            call.finish(result, error)
            self._calls.discard(call)  # after: see _cancel
            assert self._nudged is not None
            self._nudged.set()  # close() may be waiting for the last call


def _loop_died(failure: BaseException | None) -> RuntimeError:
    error = RuntimeError("aiospawn.sync's event loop thread ended while a call was waiting on it")
    error.__cause__ = failure
    return error


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


def _timeout_seconds(timeout: object) -> float | None:
    """torch passes ``timeout`` to ``multiprocessing.connection.wait``: negative means poll."""
    check_seconds("timeout", timeout, allow_negative=True)
    if timeout is None:
        return None
    assert isinstance(timeout, int | float)
    return max(float(timeout), 0.0)


def _refuse_inside_event_loop(call: str) -> None:
    library = _running_event_loop()
    if library is not None and not _called_from_a_notebook_cell():
        raise RuntimeError(
            f"aiospawn.sync.{call} blocks its thread, and this thread runs an {library} event"
            " loop that would stall meanwhile; use the async API instead: `await"
            " aiospawn.start_processes(...)` or `async with aiospawn.open_group(...) as group`"
        )


def _called_from_a_notebook_cell() -> bool:
    """True if the caller is a synchronous IPython cell (a Jupyter notebook's, say).

    ipykernel runs every cell inside its asyncio loop, so a plain cell sees a
    running loop, and even a current task (the kernel's own): neither tells a
    synchronous cell from a coroutine. The stack does. IPython executes a
    cell from its coroutine ``InteractiveShell.run_code``; a synchronous cell
    is plain code, so the nearest coroutine frame above the caller is
    ``run_code`` itself. A cell with top-level ``await``, or a coroutine
    defined anywhere, is a coroutine frame of its own, and is refused as in any
    async program. Blocking a synchronous cell blocks what the kernel expects a
    running cell to block, as ``torch.multiprocessing.spawn`` does there.
    """
    interactiveshell = sys.modules.get("IPython.core.interactiveshell")
    shell = getattr(interactiveshell, "InteractiveShell", None)
    run_code = getattr(getattr(shell, "run_code", None), "__code__", None)
    if run_code is None:
        return False
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_flags & _COROUTINE_FLAGS:
            return frame.f_code is run_code
        frame = frame.f_back
    return False


_COROUTINE_FLAGS = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _running_event_loop() -> str | None:
    """Name the event loop running in this thread, if any, without importing trio."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "trio"
    return None


def __getattr__(name: str) -> Any:
    """The rest of ``torch.multiprocessing``'s names, found on first use (see ``_torch_mp``)."""
    return _torch_mp.lookup(__name__, name)


def __dir__() -> list[str]:
    return sorted(globals().keys() | _torch_mp.names())
