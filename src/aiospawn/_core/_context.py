"""AsyncProcessContext: the public handle of one rank group.

The handle holds the documentation and the public surface; the group's state
and its supervision live in a private :class:`~aiospawn._core._group.Group`,
as ``ProcessPoolExecutor`` sits in front of its manager thread in CPython's
``concurrent.futures.process``. ``aiospawn.sync`` reaches the group through
:func:`group_of`, and uses only the group's named internal interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, final

from ._backend import Backend, HasProcess, HasSignals
from ._capture import OutputLine
from ._channel import RankChannel
from ._events import Event, GroupStatistics
from ._group import Group
from ._policy import Supervision
from ._spec import LaunchSpec, check_seconds, check_signal

__all__ = ["AsyncProcessContext", "group_of"]

T = TypeVar("T")

_CONSTRUCT = object()


@final
class AsyncProcessContext(Generic[T]):
    """A started group of ranks, each running ``fn(rank, *args)`` in its own process.

    Made by ``start_processes(..., join=False)``, ``spawn(..., join=False)`` and
    ``open_group()``; not constructed directly. Every method may be called from
    several tasks at once. The group's owner, a task of the event loop,
    supervises the group from its start to its last reap whether or not anyone
    awaits it; the methods wait for what it does. It ends with the event loop
    at the latest, after stopping and reaping every rank.

    ``async with ctx:`` ties the group to a block: a failure cancels the
    block, and the block's end waits for the group, as
    :func:`aiospawn.open_group` describes.
    """

    def __init__(self, token: object, group: Group[T]) -> None:
        if token is not _CONSTRUCT:
            raise TypeError(
                "AsyncProcessContext is made by start_processes(join=False) or open_group()"
            )
        self._group = group

    @classmethod
    async def _start(
        cls, spec: LaunchSpec, supervision: Supervision, backend: Backend
    ) -> AsyncProcessContext[T]:
        """Start every rank of ``spec``; on any error or cancellation, stop those that started."""
        group: Group[T] = await Group.start(spec, supervision, backend)
        return cls(_CONSTRUCT, group)

    @property
    def processes(self) -> list[Any]:
        """The ``multiprocessing`` process objects of the current attempts, index = rank.

        ``None`` for a rank whose backend has none (Ray).
        """
        return [
            rank.process if isinstance(rank, HasProcess) else None for rank in self._group.attempts
        ]

    def pids(self) -> list[int]:
        """The ranks' process ids (of their current attempts), index = rank."""
        return [rank.pid for rank in self._group.attempts if rank.pid is not None]

    @property
    def results(self) -> list[T]:
        """What each rank's ``fn`` returned, index = rank.

        Raises:
            RuntimeError: ``join()`` has not returned True yet.
        """
        results = self._group.results
        if results is None:
            raise RuntimeError(
                "results are available once join() has returned True (every rank has"
                " returned); await ctx.join() first"
            )
        return results

    async def output(self) -> AsyncIterator[OutputLine]:
        """Yield the captured lines of every rank as they are written.

        Each item is an ``OutputLine(rank, stream, line)``, the line without its
        newline. Lines of one rank and stream keep their order. Iteration ends
        once every rank has exited and its last lines were delivered. Lines are
        read as they are written, whether or not anyone awaits the group. Up to 10,000 lines
        are held: while an iteration is attached, a rank that writes faster
        than it reads is held back (its writes block) until it catches up;
        while nobody iterates, the oldest lines are dropped instead, so a rank
        never blocks for ever because nobody reads.

        Raises:
            RuntimeError: Neither ``stdout`` nor ``stderr`` is ``"capture"``.
        """
        capture = self._group.capture
        if capture is None:
            raise RuntimeError('ctx.output() needs stdout="capture" or stderr="capture"')
        # Closed with this generator, so that a consumer that stops iterating
        # detaches at once and no longer holds the ranks back.
        async with contextlib.aclosing(capture.lines()) as lines:
            async for line in lines:
                yield line

    def events(self) -> AsyncGenerator[Event, None]:
        """Yield the group's lifecycle events, from its start, as they happen.

        Each item is an immutable record (``Started``, ``Exited``, ``Hung``,
        ``Restarting``, ``Terminating``, ``Stopped``) with the rank, its pid, a
        ``time.monotonic()`` and a ``time.time()`` timestamp. Iteration ends
        after every rank's ``Stopped``. Any number of tasks may iterate at
        once, each at its own pace. Events come as they happen, whether or not
        anyone awaits the group.

        The group holds its newest 10,000 events and never waits for a
        consumer: one that falls further behind gets an ``EventsLost(count)``
        and goes on from the oldest event still held. To stop early, iterate
        inside ``contextlib.aclosing(ctx.events())``.
        """
        return self._group.events.follow()

    def statistics(self) -> GroupStatistics:
        """A snapshot: ranks alive, each rank's state, restarts, last exits, readiness."""
        return self._group.statistics()

    def send_signal(self, signum: int) -> list[int]:
        """Send ``signum`` to every rank still running; the group goes on.

        For a signal the ranks act on: ``SIGUSR1`` to make them checkpoint
        ahead of a preemption, as ``aiospawn run --signals-to-handle`` passes
        it on. A local rank gets it with its process group, which holds the
        processes it started (unless they left it). Ranks not started yet,
        and ranks that have exited, are left alone. Nothing is stopped: a
        rank that dies of the signal fails the group as any death does (to
        stop ranks, use :meth:`terminate`). So does a rank that has not
        installed its handler yet, where the signal's default action ends
        the process (``SIGUSR1``'s does): install it before ``aiospawn.ready()``
        and call :meth:`wait_ready` first.

        Returns:
            The ranks the signal was sent to, in rank order.

        Raises:
            TypeError: ``signum`` is not an ``int`` (``signal.SIGUSR1`` is
                one; a ``bool`` is refused).
            ValueError: ``signum`` is not a signal of this platform, or is
                ``SIGKILL`` or ``SIGSTOP``, which no rank can act on (to stop
                ranks, use :meth:`terminate`). Nothing was sent.
            RuntimeError: The backend cannot signal its ranks (Ray); nothing
                was sent.
        """
        check_signal(signum)
        attempts = self._group.attempts
        ranks = [rank for rank in attempts if isinstance(rank, HasSignals)]
        if len(ranks) < len(attempts):
            raise RuntimeError("this group's backend cannot pass signals to its ranks")
        return [rank.rank for rank in ranks if rank.pass_signal(signum)]

    def channel(self, rank: int) -> RankChannel:
        """The channel to rank ``rank`` (its current attempt): an anyio object stream.

        ``await ch.send(obj)`` reaches the rank's ``aiospawn.channel().receive()``;
        ``await ch.receive()`` (or ``async for``) returns what the rank sent.
        Objects are pickled; large ones are pickled and unpickled on a worker
        thread. A restarted rank has a new channel: ask again after a restart.
        The old one ends with its attempt.

        Raises:
            TypeError, ValueError: ``rank`` is not a rank of this group.
            RuntimeError: The backend's ranks have no channels.
        """
        return self._group.channel(rank)

    async def wait_ready(self, timeout: float | None = None) -> list[Any]:
        """Wait until every rank has called ``aiospawn.ready()``; return their payloads.

        The group goes on being supervised meanwhile: a rank that fails
        before it is ready fails the wait with its exception (the ranks are
        shut down first), and a rank restarted by the group's ``restart``
        policy counts once its new attempt is ready.

        Args:
            timeout: Seconds to wait; ``None`` uses the group's
                ``startup_timeout`` (no limit if that is ``None`` too).

        Returns:
            The ``payload`` each rank passed to ``ready()``, index = rank.

        Raises:
            TimeoutError: ``timeout`` passed; the message names the ranks
                that are not ready. The group keeps running.
            ProcessException: A rank failed before every rank was ready.
            pickle.UnpicklingError: A rank's payload cannot be unpickled here
                (the lowest such rank's; its cause is what the unpickling
                raised, ``SystemExit`` included). The group keeps running.
            RuntimeError: A rank returned before it was ready, or the backend
                has no channels.
            ValueError: ``timeout`` is negative.

        Cancellation:
            Safe: the group keeps running, and readiness seen so far is kept.
        """
        check_seconds("timeout", timeout)
        return await self._group.wait_ready(timeout)

    async def call(
        self,
        method: str,
        /,
        *args: Any,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``handler.method(*args, **kwargs)`` on every rank (or on ``ranks``) at once.

        Each rank answers with the handler it passed to ``aiospawn.serve()``.
        Arguments and results are pickled; the request is pickled once. Each
        rank is called once: ``ranks`` must not name a rank twice. Calls made
        at once overlap in an async rank (each runs in a task of its own);
        a sync rank answers them one at a time.

        Returns:
            The results, in the order of ``ranks`` (rank order by default).

        Raises:
            Exception: A handler raised: that exception (of the lowest such
                rank), with a note naming the rank and one holding the rank's
                traceback. The group is not failed, and the ranks go on serving.
            ProcessException: A rank failed (exited badly, was killed or
                stopped, or broke its channel) before it answered; raised at once.
            pickle.UnpicklingError: A rank's answer cannot be unpickled here
                (the lowest such rank's; its cause is what the unpickling
                raised, ``SystemExit`` included). The ranks go on serving. (An
                argument the rank cannot unpickle is the rank's error, raised
                as a handler's.)
            anyio.BrokenResourceError: A rank ended, or closed its channel,
                without answering.
            anyio.ClosedResourceError: A rank's channel was closed here
                (``aclose()``, ``send_eof()``, or the end of the ``async with``
                block).
            TimeoutError: ``timeout`` seconds passed; the message names the
                ranks that did not answer.
            TypeError: The arguments cannot be pickled, or ``ranks`` is not
                a sequence of ranks.
            ValueError: ``ranks`` names a rank outside the group, or one rank
                twice; the arguments pickle to more than a frame carries
                (1 GiB); or ``timeout`` is negative. Nothing was sent.

        Cancellation:
            Safe: answers that arrive later are dropped, never delivered to a
            later call. Each rank that has not answered is told that the call
            is given up (so it is when ``timeout`` passes, or when the call
            fails because a rank died); ``call()`` does not wait for the ranks
            to act on it. An async rank cancels the call's task, whose
            ``finally`` blocks run. A sync rank drops the call if it has not
            started it; a handler already running runs to its end, and the
            rank's next call waits behind it.
        """
        if not isinstance(method, str):
            raise TypeError(f"method must be the name of a handler method, got {method!r}")
        check_seconds("timeout", timeout)
        if ranks is not None and (
            isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence)
        ):
            raise TypeError(f"ranks must be a sequence of ranks, got {ranks!r}")
        return await self._group.call(method, args, kwargs, ranks, timeout)

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
        return await self._group.join(timeout, grace_period)

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
        await self._group.terminate(grace_period)

    async def __aenter__(self) -> Self:
        if self._group.in_block:
            raise RuntimeError(f"{self!r} is already supervising an async with block")
        await self._group.enter_block()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return await self._group.exit_block(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"<AsyncProcessContext nprocs={self._group.spec.nprocs}{self._group.summary()}>"


def group_of(ctx: AsyncProcessContext[T]) -> Group[T]:
    """The group behind ``ctx``: the internal interface of ``aiospawn.sync``."""
    return ctx._group
