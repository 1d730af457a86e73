"""A group's live ranks: the channel of each current attempt, readiness, and calls.

One concern: what users do with running ranks. :class:`LiveRanks` holds one
:class:`~._conversation.Conversation` per attempt that has a link, from the
attempt's making to its release; hands out each rank's
:class:`~._channel.RankChannel`; sends ``ctx.call()`` to several ranks and
gathers their answers; and decodes what ``aiospawn.ready()`` passed.

It reads the group through a narrow interface passed to it: the current
attempt at each rank, and two callables the conversations call (a rank
broke its channel; wait until an attempt's exit is recorded). The group
(``_group``) decides the rest: when an attempt is made, released or
replaced, whether a broken channel fails the group, and when ``wait_ready()``
has waited long enough. The group's owner runs each conversation's pump
(:meth:`LiveRanks.pump`) for as long as its attempt runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

from ._backend import RankHandle
from ._channel import RankChannel
from ._concurrency import Broadcast
from ._conversation import Conversation
from ._events import EventLog, Ready
from ._outcome import BrokenChannel, RankExit, rebuild_raised
from ._pickles import decode, encode
from ._pool import SegmentPool, close_all, pool_bytes

if TYPE_CHECKING:
    from aiospawn._rank.buffers import Packed
    from aiospawn._rank.wire import Payload


class LiveRanks:
    """The channels of a group's current attempts, and the calls made over them."""

    def __init__(
        self,
        nprocs: int,
        attempt: Callable[[int], RankHandle],
        *,
        transport: str,
        events: EventLog,
        changed: Broadcast,
        on_broken: Callable[[RankHandle, BrokenChannel], None],
        exit_of: Callable[[RankHandle], Awaitable[RankExit | None]],
    ) -> None:
        """Hold no channel yet.

        Args:
            nprocs: The group's number of ranks.
            attempt: The current attempt at a rank, by index.
            transport: What makes the ranks, for the error when they have no
                channels (the launcher's class name).
            events: The group's event log, for the ``Ready`` events.
            changed: Notified when a rank is ready.
            on_broken: Called when an attempt sends a frame that breaks the format.
            exit_of: Waits until the group has recorded an attempt's exit.
        """
        self._nprocs = nprocs
        self._attempt = attempt
        self._transport = transport
        self._events = events
        self._changed = changed
        self._on_broken = on_broken
        self._exit_of = exit_of
        # Per attempt with a link: the current ones, and for a moment while
        # a restart makes their successors, those too.
        self._channels: dict[RankHandle, Conversation] = {}
        self._closed = False  # the block ended: ranks' serve() may return
        self._call_ids = itertools.count(1)
        # The reused memfds of large buffers sent to the ranks: made with the
        # first attempt whose link shares memory, kept across restarts, given
        # up at the group's end (aclose).
        self._pool: SegmentPool | None = None

    # ------------------------------------------------------------ the group's

    def add(self, rank: RankHandle) -> None:
        """Open the channel of a new attempt, if the backend gives it one."""
        if rank.link is None:
            return
        pool = None
        if rank.link.shares_memory:
            if self._pool is None:
                self._pool = SegmentPool(
                    pool_bytes(),
                    getattr(rank.link, "keep_descriptor", None),
                    getattr(rank.link, "drop_descriptor", None),
                )
            pool = self._pool
        channel = self._channels[rank] = Conversation(
            rank, rank.link, self._on_ready, self._on_broken, self._exit_of, pool
        )
        if self._closed:
            channel.close_sending()

    def pump(self, rank: RankHandle) -> Callable[[], Coroutine[Any, Any, None]] | None:
        """What moves ``rank``'s frames until its stream ends, if it has a channel.

        The group's owner runs it as a task for as long as the attempt runs.
        """
        channel = self._channels.get(rank)
        return None if channel is None else channel.pump

    def release(self, ranks: Iterable[RankHandle]) -> None:
        """Keep what the ranks sent before they ended, then release their transports."""
        for rank in ranks:
            channel = self._channels.get(rank)
            if channel is not None:
                channel.drain_and_release()

    def forget(self, ranks: Iterable[RankHandle]) -> None:
        """Release the channels of replaced attempts, and drop them.

        Nothing meant for an old attempt reaches its successor: each attempt
        has a channel of its own.
        """
        for rank in ranks:
            channel = self._channels.pop(rank, None)
            if channel is not None:
                channel.drain_and_release()

    async def aclose(self) -> None:
        """Give up the pool's segments: the group has ended, and its ranks with it.

        Their memory is freed on a worker thread (some tens of milliseconds
        per 100 MB here), not on the loop. A segment a late ``send()`` still
        writes is closed once it is done.
        """
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
            evicted = pool.evicted()
            if evicted:  # most groups never sent a large buffer: no thread for them
                await anyio.to_thread.run_sync(close_all, evicted)

    def is_ready(self, rank: RankHandle) -> bool:
        """True if ``rank`` has called ``aiospawn.ready()``."""
        channel = self._channels.get(rank)
        return channel is not None and channel.ready

    def all_ready(self) -> bool:
        """True once every current attempt has called ``aiospawn.ready()``."""
        return not self._unready()

    # ------------------------------------------------------------ the users'

    def channel(self, index: int) -> RankChannel:
        """The channel of rank ``index``'s current attempt."""
        return self._conversation(index).handle

    def check(self) -> None:
        """Raise ``RuntimeError`` if the group's ranks have no channels."""
        for index in range(self._nprocs):
            self._conversation(index)

    async def ready_payloads(self, timed_out_after: float | None) -> list[Any]:
        """What each current attempt passed to ``aiospawn.ready()``, in rank order.

        Args:
            timed_out_after: The seconds ``wait_ready()`` waited, if its time
                ran out; None if the group settled first.

        Raises:
            TimeoutError: The time ran out before every rank was ready.
            RuntimeError: The group ended before every rank was ready.
            pickle.UnpicklingError: A payload cannot be decoded.
        """
        unready = self._unready()
        if timed_out_after is not None and unready:
            raise TimeoutError(
                f"rank(s) {', '.join(str(rank.rank) for rank in unready)} did not call"
                f" aiospawn.ready() within {timed_out_after:g} s"
            )
        if unready:
            raise RuntimeError(
                "the group ended before every rank called aiospawn.ready(): rank(s)"
                f" {', '.join(str(rank.rank) for rank in unready)} returned first"
            )
        ranks = [self._attempt(index) for index in range(self._nprocs)]
        return [
            await decode(
                self._channels[rank].ready_payload or b"", f"rank {rank.rank}'s ready payload"
            )
            for rank in ranks
        ]

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        ranks: Sequence[int] | None,
        timeout: float | None,
    ) -> list[Any]:
        """``AsyncProcessContext.call()``, its arguments checked."""
        targets = list(range(self._nprocs)) if ranks is None else list(ranks)
        channels = {index: self._conversation(index) for index in targets}
        if len(channels) < len(targets):
            # One answer per rank: a rank named twice would be asked once and
            # its answer returned twice, or asked twice with no order between.
            twice = sorted({index for index in targets if targets.count(index) > 1})
            raise ValueError(
                f"ranks must name each rank once, got {ranks!r}"
                f" (rank(s) {', '.join(map(str, twice))} more than once)"
            )
        # Encoded once for every rank: a large buffer is written into one
        # memfd, which each rank maps (each queue sends a copy of its descriptor).
        shared = all(channel.shares_memory for channel in channels.values())
        request = await encode((method, args, kwargs), shared, self._pool if shared else None)
        try:
            return await self._call(method, request, channels, targets, timeout)
        finally:
            request.close()

    async def _call(
        self,
        method: str,
        request: Packed,
        channels: dict[int, Conversation],
        targets: list[int],
        timeout: float | None,
    ) -> list[Any]:
        await checkpoint_if_cancelled()
        call_id = next(self._call_ids)
        replies: dict[int, Payload] = {}
        ended: dict[int, Exception] = {}
        # No task per rank: every CALL frame is queued (and written, if the
        # socket takes it) in one pass, then one wait covers every reply.
        answered = Broadcast()
        asked: list[tuple[int, Conversation]] = []
        try:
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                for index, channel in channels.items():
                    try:
                        await channel.start_call(call_id, request, answered)
                    except anyio.ClosedResourceError as exc:
                        ended[index] = exc
                        break
                    asked.append((index, channel))
                while not ended and len(replies) < len(asked):
                    for index, channel in asked:
                        if index in replies:
                            continue
                        reply = channel.reply(call_id)
                        if reply is not None:
                            replies[index] = reply
                        elif channel.unanswerable(call_id):
                            # The call has failed: stop waiting for the others.
                            ended[index] = await channel.call_error()
                    if not ended and len(replies) < len(asked):
                        await answered.wait()
        finally:
            for _, channel in asked:
                channel.end_call(call_id)
        if ended:
            first = min(ended)
            raise ended[first]
        missing = [index for index in targets if index not in replies]
        if missing:
            raise TimeoutError(
                f"ctx.call({method!r}): rank(s) {', '.join(map(str, missing))} did not"
                f" answer within {timeout:g} s"
            )
        answers = {
            index: await decode(replies[index], f"rank {index}'s answer to ctx.call({method!r})")
            for index in sorted(targets)  # the lowest rank's error, if several
        }
        raised = sorted(index for index, (ok, _) in answers.items() if not ok)
        if raised:
            error = rebuild_raised(answers[raised[0]][1])
            error.add_note(
                f"aiospawn: raised by rank {raised[0]}'s handler in ctx.call({method!r})"
            )
            if len(raised) > 1:
                error.add_note(f"aiospawn: ranks {', '.join(map(str, raised[1:]))} raised too")
            raise error
        return [answers[index][1] for index in targets]

    def close_sending(self) -> None:
        """Close the supervisor's side of every channel: a rank's ``serve()`` returns.

        Attempts made later (restarts) start with their sending side closed.
        """
        self._closed = True
        for channel in self._channels.values():
            channel.close_sending()

    # ------------------------------------------------------------------ inside

    def _conversation(self, index: int) -> Conversation:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"rank must be an int, got {index!r}")
        if not 0 <= index < self._nprocs:
            raise ValueError(f"rank {index} is not in this group of {self._nprocs}")
        channel = self._channels.get(self._attempt(index))
        if channel is None:
            raise RuntimeError(f"{self._transport}'s ranks have no channels")
        return channel

    def _on_ready(self, rank: RankHandle) -> None:
        if rank is self._attempt(rank.rank):  # not a replaced attempt's late READY
            self._events.append(Ready(rank=rank.rank, pid=rank.pid))
        self._changed.notify()

    def _unready(self) -> list[RankHandle]:
        """The current attempts that have not called ``ready()``."""
        ranks = [self._attempt(index) for index in range(self._nprocs)]
        return [rank for rank in ranks if not self._channels[rank].ready]
