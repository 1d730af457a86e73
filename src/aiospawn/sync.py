"""A blocking drop-in for ``torch.multiprocessing.spawn``, built on the async core.

Change one import and keep the calls, the messages and the exceptions::

    import aiospawn.sync as mp  # was: import torch.multiprocessing as mp

    mp.spawn(train, args=(world_size,), nprocs=world_size)

Each group gets its own event loop on a private daemon thread; the blocking
calls reach it through a blocking portal. The loop thread, not the caller,
owns the ranks, so they outlive the thread that started them, and they die
with the process (the core's parent guard watches the process, not a thread)::

    caller thread                          loop thread "aiospawn-sync-loop" (daemon)
    ─────────────                          ─────────────────────────────────────────
    start_processes() ───── portal ──────► AsyncProcessContext._start()
    ProcessContext.join() ─ portal ──────► its group's wait_step() (see _core._group)
        │ KeyboardInterrupt (or any         │ cancelled: SIGTERM, grace, SIGKILL, reap
        └ exception) cancels the call ────► └ then the caller's exception propagates
    joined (True), raised or terminated ─► portal stopped, the loop thread ends

What this module keeps from torch: the names in ``__all__`` (plus
``ENV_VAR_PARALLEL_START``, the name of torch's environment variable for
parallel starts, which aiospawn does not need: its starts are always
concurrent), ``fn(rank, *args)``, ``join()`` returning False after each clean
exit while ranks remain, the shutdown escalation and its WARNING logs (on the
``aiospawn`` logger), and the exception messages. What it fixes: see the README.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar, TypeVarTuple, cast, overload

import anyio
from anyio.from_thread import BlockingPortal

from ._api import start_processes as _start_group
from ._api import warn_spawn_only
from ._core._context import AsyncProcessContext, group_of
from ._core._errors import ProcessException, ProcessExitedException, ProcessRaisedException
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

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: The environment variable torch reads to start ``forkserver`` ranks in
#: parallel. Kept for compatibility only: aiospawn starts ranks concurrently
#: under every start method where that is safe, whatever it says.
ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"

_LOOP_THREAD_NAME = "aiospawn-sync-loop"


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
        self._concluding = False
        self._error: ProcessException | None = None
        self.processes: list[Any] = [] if _group is None else _group.processes
        self.error_files: list[str] = [""] * len(self.processes)
        self.sentinels: dict[int, int] = {
            process.sentinel: rank for rank, process in enumerate(self.processes)
        }

    @classmethod
    def _start(
        cls,
        fn: Callable[..., Any],
        args: Sequence[Any],
        nprocs: int,
        daemon: bool,
        start_method: str | None,
    ) -> ProcessContext:
        """Start a group on a new loop thread; if anything goes wrong, stop what started."""
        if isinstance(nprocs, int) and not isinstance(nprocs, bool) and nprocs == 0:
            # torch starts nothing and joins at once; the core wants a positive nprocs.
            if not callable(fn):
                raise TypeError(f"fn must be callable, got {fn!r}")
            resolve_start_method(start_method)
            return cls()
        loop = _LoopThread()
        started: list[AsyncProcessContext[Any]] = []

        async def start() -> None:
            # Through the async API's Sequence-typed path; its overloads want a tuple.
            start_group = cast("Callable[..., Awaitable[AsyncProcessContext[Any]]]", _start_group)
            group = await start_group(
                fn, args, nprocs, join=False, daemon=daemon, start_method=start_method
            )
            # Recorded on the loop before the call returns, so that an
            # interruption racing with the end of the start still finds it.
            started.append(group)

        try:
            loop.run(start)
        except BaseException:
            try:
                if started:  # the start finished as the caller was interrupted
                    loop.run(started[0].terminate)
            finally:
                loop.close()
            raise
        return cls(started[0], loop)

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
        {pid} via signal SIGTERM"`` on the ``aiospawn`` logger, then 30 s
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

        An exception raised in the calling thread while it waits (a
        ``KeyboardInterrupt`` from Ctrl-C) shuts the group down as a failure
        does, and propagates once every rank has been reaped. A second one
        during that shutdown propagates at once; the loop thread finishes the
        shutdown and the next ``join()`` reports it.
        """
        _refuse_inside_event_loop("ProcessContext.join()")
        wait = _timeout_seconds(timeout)
        check_seconds("grace_period", grace_period)
        with self._lock:
            return self._join(wait, grace_period, until_all=False)

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
        loop, group = self._loop, self._group
        if loop is not None and group is not None:
            # Not under the lock: a join() blocked in another thread holds it,
            # and must see this shutdown (it then raises) rather than wait.
            with contextlib.suppress(_LoopClosed):
                loop.run(group.terminate, grace_period)
        with self._lock:
            if not self._finished:
                self._conclude(grace_period)

    def __repr__(self) -> str:
        state = f"unjoined={len(self.sentinels)}"
        if self._error is not None:
            state += f" failed=rank {self._error.error_index}"
        return f"<{type(self).__name__} nprocs={len(self.processes)} {state}>"

    def _join(self, timeout: float | None, grace_period: float | None, *, until_all: bool) -> bool:
        if self._finished:
            return self._replay()
        loop, group = self._loop, self._group
        assert loop is not None
        assert group is not None
        try:
            done, unjoined = loop.run(_join_step, group, timeout, grace_period, until_all)
        except ProcessException as error:  # the group failed and has been shut down
            self._finish(error)
            raise
        except BaseException:
            # The caller was interrupted: the cancelled join has shut the
            # group down; record how it ended, then let the exception go.
            if not self._concluding:
                self._conclude(grace_period)
            raise
        self.sentinels = {self.processes[rank].sentinel: rank for rank in unjoined}
        if done:
            self._finish(None)
        return done

    def _conclude(self, grace_period: float | None) -> None:
        """Terminate whatever still runs, record the outcome ``join()`` reports, end the loop."""
        assert self._loop is not None
        assert self._group is not None
        self._concluding = True
        # If this wait is interrupted too, the group stays unfinished: the
        # loop thread completes the shutdown and the next join() reports it.
        error = self._loop.run(_terminate_and_report, self._group, grace_period)
        self._finish(error)

    def _finish(self, error: ProcessException | None) -> None:
        self._error = error
        self._finished = True
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        # The loop thread has ended: the group's state is ours to read.
        assert self._group is not None
        self.sentinels = {
            self.processes[rank].sentinel: rank for rank in group_of(self._group).unjoined()
        }

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

    An exception raised in the calling thread while it waits (a
    ``KeyboardInterrupt``) stops every rank (SIGTERM, 30 s, SIGKILL) and
    reaps it before it propagates.
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
    context = ProcessContext._start(fn, args, nprocs, daemon, start_method)
    if not join:
        return context
    try:
        with context._lock:
            context._join(None, None, until_all=True)
    except BaseException:
        # Interrupted between the start and the join: nobody stopped the ranks yet.
        if not context._finished and not context._concluding:
            context._conclude(None)
        raise
    return None


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


class _LoopThread:
    """An asyncio event loop on a private daemon thread, reached through a blocking portal.

    Not ``anyio.from_thread.start_blocking_portal``: its thread belongs to a
    ``ThreadPoolExecutor``, which the interpreter joins at exit, so a group
    left running would hang the exit. This thread is a daemon; if the process
    exits with ranks running, the ranks' parent guards kill them.
    """

    def __init__(self) -> None:
        self._portal: BlockingPortal | None = None
        self._failure: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=_LOOP_THREAD_NAME, daemon=True)
        self._thread.start()
        try:
            self._ready.wait()
        except BaseException:
            self._ready.wait()
            self.close()
            raise
        if self._portal is None:
            raise RuntimeError("aiospawn.sync could not start its event loop") from self._failure

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and wait for its result.

        If the wait is interrupted (``KeyboardInterrupt``), ``fn`` is cancelled
        and the interruption propagates once ``fn`` has ended: the core's
        cancellation shuts the group down and reaps it first.
        """
        portal = self._portal
        if portal is None:
            raise _LoopClosed
        ended = threading.Event()

        async def call() -> T:
            try:
                return await fn(*args)
            finally:
                ended.set()

        try:
            future = portal.start_task_soon(call)
        except RuntimeError as exc:  # stopped by another thread meanwhile
            raise _LoopClosed from exc
        try:
            return future.result()
        except BaseException:
            if future.cancel():
                ended.wait()
            raise

    def close(self) -> None:
        """Stop the portal and wait for the loop thread to end."""
        portal, self._portal = self._portal, None
        if portal is not None:
            portal.start_task_soon(portal.stop)
        self._thread.join()

    def _run(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:  # pragma: no cover - a broken event loop policy
            self._failure = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        async with BlockingPortal() as portal:
            self._portal = portal
            self._ready.set()
            await portal.sleep_until_stopped()


async def _join_step(
    group: AsyncProcessContext[Any],
    seconds: float | None,
    grace_period: float | None,
    until_all: bool,
) -> tuple[bool, list[int]]:
    supervisor = group_of(group)
    if until_all:
        done = await supervisor.join(seconds, grace_period)
    else:
        done = await supervisor.wait_step(seconds, grace_period)
    return done, supervisor.unjoined()


async def _terminate_and_report(
    group: AsyncProcessContext[Any], grace_period: float | None
) -> ProcessException | None:
    """Shut the group down (a no-op once it is over) and return what join() reports."""
    await group.terminate(grace_period)
    try:
        await group.join(0)
    except ProcessException as error:
        return error
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
            f"aiospawn.sync.{call} blocks its thread, and this thread runs a {library} event"
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
