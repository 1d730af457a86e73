"""A blocking drop-in for ``torch.multiprocessing.spawn``, built on the async core.

(Most of this module is torch's call signatures, with their overloads, and
the docstrings that keep torch's contract. The machinery under them is in
``aiospawn._sync``: the blocking hand-off to a private event loop that no
interruption of the caller can strand (``_portal``), Ctrl-C raised at one
point (``_interrupts``), and a group's way to its end from wherever an
interruption left it (``_blocking_group``).)

Change one import and keep the calls, the messages and the exceptions::

    import aiospawn.sync as mp  # was: import torch.multiprocessing as mp

    mp.spawn(train, args=(world_size,), nprocs=world_size)

Each group gets its own event loop on a private daemon thread; the blocking
calls hand it coroutine functions to run (``_sync._portal.LoopThread``). The loop
thread, not the caller, owns the ranks, so they outlive the thread that
started them, and they die with the process (the core's parent guard watches
the process, not a thread)::

    caller thread                          loop thread "aiospawn-sync-loop" (daemon)
    ─────────────                          ─────────────────────────────────────────
    start_processes() ──── a Call ───────► aiospawn.start_processes(join=False)
    ProcessContext.join() ─ a Call ──────► its group's wait_step() (see _core._group)
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

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVarTuple, overload

# The errors through the package, which names them aiospawn's in tracebacks and reprs.
from . import ProcessException, ProcessExitedException, ProcessRaisedException, _torch_mp
from ._api import warn_spawn_only
from ._core._spec import check_seconds
from ._local._strategy import resolve_start_method
from ._sync import _blocking_group
from ._sync._interrupts import with_ctrl_c_deferred
from ._sync._loop_guard import refuse_inside_event_loop

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

    from ._core._context import AsyncProcessContext
    from ._sync._blocking_group import BlockingGroup

Ts = TypeVarTuple("Ts")

#: The environment variable torch reads to start ``forkserver`` ranks in
#: parallel. Kept for compatibility only: aiospawn starts ranks concurrently
#: under every start method where that is safe, whatever it says.
ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"


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

    def __init__(self, _blocking: BlockingGroup | None = None) -> None:
        self._blocking = _blocking
        self.processes: list[Any] = [] if _blocking is None else _blocking.processes
        self.error_files: list[str] = [""] * len(self.processes)
        self.sentinels: dict[int, int] = {}
        self._read_sentinels()

    def pids(self) -> list[int]:
        """Return the ranks' process ids, index = rank.

        Returns:
            One pid per rank.
        """
        return [] if self._blocking is None else self._blocking.pids()

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
        once and hurries it: the ranks still running get SIGKILL now, not at
        the end of the grace period; the loop thread reaps them and the next
        ``join()`` reports it.
        """
        refuse_inside_event_loop("ProcessContext.join()")
        wait = _timeout_seconds(timeout)
        check_seconds("grace_period", grace_period)
        group = self._blocking
        if group is None:
            return True
        try:
            return with_ctrl_c_deferred(lambda: group.join(wait, grace_period))
        finally:
            self._read_sentinels()

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
        refuse_inside_event_loop("ProcessContext.terminate()")
        check_seconds("grace_period", grace_period)
        group = self._blocking
        if group is None:
            return
        try:
            with_ctrl_c_deferred(lambda: group.terminate(grace_period))
        finally:
            self._read_sentinels()

    def __repr__(self) -> str:
        state = f"unjoined={len(self.sentinels)}"
        error = None if self._blocking is None else self._blocking.error
        if error is not None:
            state += f" failed=rank {error.error_index}"
        return f"<{type(self).__name__} nprocs={len(self.processes)} {state}>"

    @property
    def _group(self) -> AsyncProcessContext[Any] | None:
        """The async group under this context, if any (the tests reach its supervisor so)."""
        return None if self._blocking is None else self._blocking.group

    def _read_sentinels(self) -> None:
        unjoined = [] if self._blocking is None else self._blocking.unjoined
        self.sentinels = {self.processes[rank].sentinel: rank for rank in unjoined}


class SpawnContext(ProcessContext):
    """Deprecated alias of :class:`ProcessContext`, kept because torch keeps it.

    Constructing one warns, in torch's words, with a :class:`UserWarning`.
    """

    def __init__(self, _blocking: BlockingGroup | None = None) -> None:
        warnings.warn(
            "SpawnContext is renamed to ProcessContext since 1.4 release.",
            UserWarning,
            stacklevel=2,
        )
        super().__init__(_blocking)


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
    refuse_inside_event_loop("start_processes()")
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
    group = with_ctrl_c_deferred(
        lambda: _blocking_group.start(fn, args, nprocs, join, daemon, start_method)
    )
    return None if join else ProcessContext(group)


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
    refuse_inside_event_loop("spawn()")
    if start_method != "spawn":
        warn_spawn_only(start_method, "aiospawn.sync.start_processes")
    return _start_processes(fn, args, nprocs, join, daemon, "spawn")


def _timeout_seconds(timeout: object) -> float | None:
    """torch passes ``timeout`` to ``multiprocessing.connection.wait``: negative means poll."""
    check_seconds("timeout", timeout, allow_negative=True)
    if timeout is None:
        return None
    assert isinstance(timeout, int | float)
    return max(float(timeout), 0.0)


def __getattr__(name: str) -> Any:
    """The rest of ``torch.multiprocessing``'s names, found on first use (see ``_torch_mp``)."""
    return _torch_mp.lookup(__name__, name)


def __dir__() -> list[str]:
    return sorted(globals().keys() | _torch_mp.names())
