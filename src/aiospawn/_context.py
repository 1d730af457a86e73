"""AsyncProcessContext: one rank group, from its start to the last reap.

A group's state is derived from its ranks and three facts (start finished,
root failure, shutdown begun), never stored twice::

    starting ──► running ──┬──────────────────────────────► reaped (all returned)
       │                   │ a rank fails by itself
       │                   ├──► failing ───┐  optional grace wait
       │                   │ terminate() / │
       │                   │ cancellation  ▼
       │                   └──► terminating ──► SIGTERM ─► grace ─► SIGKILL ─► reaped
       │ start error or cancellation                ▲
       └────────────────────────────────────────────┘

Every exit a rank makes is seen by exactly one watcher (``LocalRank.wait``),
which reports it through :meth:`AsyncProcessContext._on_exit`. The first rank
to fail by itself, not because we stopped it, is the root cause; every
``join()`` raises an exception equal to the one built from it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, final

import anyio
import anyio.abc
from anyio.lowlevel import checkpoint

from ._errors import ProcessException, ProcessRaisedException, raised_message
from ._launch import LaunchSpec, check_seconds, make_rank, start_ranks
from ._outcome import RankExit
from ._output import CaptureBuffer, OutputLine
from ._shield import run_to_completion
from ._shutdown import Shutdown
from ._watch import LocalRank

__all__ = ["AsyncProcessContext"]

T = TypeVar("T")

_CONSTRUCT = object()

#: Results larger than this are unpickled on a worker thread, not on the loop.
_DECODE_ON_THREAD_BYTES = 1 << 20


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

    def __init__(self, token: object, spec: LaunchSpec, grace_period: float | None) -> None:
        if token is not _CONSTRUCT:
            raise TypeError(
                "AsyncProcessContext is made by start_processes(join=False) or open_group()"
            )
        self._spec = spec
        self._grace_period = grace_period
        self._capture = CaptureBuffer() if spec.output.captures else None
        self._ranks = [
            make_rank(spec, index, self._on_exit, self._capture) for index in range(spec.nprocs)
        ]
        self._started = anyio.Event()
        self._root: RankExit | None = None
        self._shutdown: Shutdown | None = None
        self._shutdown_done = anyio.Event()
        self._stuck: list[LocalRank] = []
        self._results: list[T] | None = None
        self._body: anyio.abc.TaskGroup | None = None

    @classmethod
    async def _start(cls, spec: LaunchSpec, grace_period: float | None) -> AsyncProcessContext[T]:
        """Start every rank of ``spec``; on any error or cancellation, stop those that started."""
        self = cls(_CONSTRUCT, spec, grace_period)
        try:
            await start_ranks(self._ranks, spec.start_method)
        except BaseException:
            self._started.set()
            await self._shut_down(None, after_failure=False)
            raise
        self._started.set()
        return self

    @property
    def processes(self) -> list[Any]:
        """The ``multiprocessing`` process objects, index = rank."""
        return [rank.process for rank in self._ranks]

    def pids(self) -> list[int]:
        """The ranks' process ids, index = rank."""
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

    async def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for every rank to finish; on the first failure, stop the rest and raise.

        Idempotent: once it has returned True it keeps returning True, and once
        it has raised, every later call raises an equal exception (same class,
        ``error_index`` and message), never one about a rank we stopped.

        Args:
            timeout: Seconds to wait; ``None`` waits as long as it takes and
                ``0`` checks once without waiting.
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
        once their start has finished. Ranks that already exited are left alone.
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
        body.start_soon(self._watch_during_body)
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
        if self._root is not None:
            state += f" failed=rank {self._root.rank} ({self._root.summary()})"
        return f"<AsyncProcessContext nprocs={len(self._ranks)}{state}>"

    def _on_exit(self, exit: RankExit) -> None:
        if self._root is None and not exit.succeeded and not exit.stopped_by_us:
            self._root = exit
            if self._body is not None:  # an async with block runs: stop it now
                self._body.cancel_scope.cancel()
        if self._capture is not None and self._all_exited():
            self._capture.close()

    async def _join(
        self, timeout: float | None, grace_period: float | None, *, until_all: bool
    ) -> bool:
        """``join()``; with ``until_all=False`` it also returns (False) after any one exit."""
        try:
            await checkpoint()
            if self._root is None and self._shutdown is None:
                exited = self._exited_count()
                for rank in self._ranks:
                    rank.poll()
                # Without until_all, an exit this poll found is the one to report.
                wait = until_all or self._exited_count() == exited
                if wait and self._root is None and not self._all_exited() and timeout != 0:
                    with anyio.move_on_after(math.inf if timeout is None else timeout):
                        await self._wait_for_exits(until_all=until_all)
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
        if not self._all_exited():
            return False
        await self._collect_results()
        return True

    async def _wait_for_exits(self, *, until_all: bool) -> None:
        """Return once every rank exited, a rank failed, or (``until_all=False``) any exited."""

        async def wait_for(rank: LocalRank, scope: anyio.CancelScope) -> None:
            await rank.wait()
            if self._root is not None or not until_all:
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for rank in self._ranks:
                if rank.exit is None:
                    tg.start_soon(wait_for, rank, tg.cancel_scope)

    async def _watch_during_body(self) -> None:
        # The ranks' exits are seen only while someone waits for them; when one
        # fails, _on_exit cancels the block.
        await self._wait_for_exits(until_all=True)

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
        self._shutdown = shutdown = Shutdown(grace, wait_first=after_failure)
        done = self._shutdown_done

        async def escalate() -> None:
            try:
                await self._started.wait()
                self._stuck = await shutdown.run([rank for rank in self._ranks if rank.started])
            finally:
                done.set()

        await run_to_completion(escalate)

    def _all_exited(self) -> bool:
        return all(rank.exit is not None for rank in self._ranks)

    def _exited_count(self) -> int:
        return sum(rank.exit is not None for rank in self._ranks)

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
        return error

    async def _collect_results(self) -> None:
        if self._results is not None:
            return
        exits = [rank.exit for rank in self._ranks]
        size = sum(len(exit.frame[1]) for exit in exits if exit and exit.frame)
        if size > _DECODE_ON_THREAD_BYTES:
            self._results = await anyio.to_thread.run_sync(_decode_results, exits)
        else:
            self._results = _decode_results(exits)


def _decode_results(exits: Sequence[RankExit | None]) -> list[Any]:
    values = []
    for exit in exits:
        assert exit is not None
        try:
            values.append(exit.value())
        except Exception as exc:
            text = f"the value rank {exit.rank} returned cannot be unpickled here: {exc!r}\n"
            raise ProcessRaisedException(
                raised_message(exit.rank, text), exit.rank, exit.pid
            ) from exc
    return values
