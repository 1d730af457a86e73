"""What runs on the Ray cluster: one actor per rank, and a signal board per group.

A rank is a plain (synchronous) Ray actor, so ``fn`` runs on the main thread
of the actor's worker process, as it does in a local rank: it may install
signal handlers, and ``SIGTERM`` gets its default action back before ``fn``
runs (Ray's worker replaces it with one that raises ``SystemExit``).

A plain actor answers one call at a time, so while ``fn`` runs it cannot take
a "please stop" call. The group's :class:`SignalBoard` (a small asyncio actor,
no CPU) carries signals instead: a thread in each rank waits on the board and
delivers what arrives to its own process with ``os.kill``, and Python's (or
the user's) handler runs as it would locally. ``SIGKILL`` never goes through
the board: the supervisor uses ``ray.kill``. Ray kills an actor whose owner
(the supervising process) dies, which is the cluster's parent-death guard.

Ray has no authentication (any client of the cluster can run code on every
node), so the board guards against mistakes and casual reach, not a hostile
cluster: neither it nor the rank actors are named, so other jobs cannot list
or look them up; every call carries the group's random token; and only the
signals the supervisor sends (:data:`BOARD_SIGNALS`) are accepted, by the
board and again by the rank.

The board also holds the frames of each rank's channel (``aiospawn.channel()``,
``ctx.channel(rank)``), in a bounded pipe per attempt and direction: the rank
actor cannot take calls of its own while ``fn`` runs, and ``_relay`` has the
picture. ``fn`` runs under the same rule as a local rank's
(``aiospawn._rank.outcome``): an ``async def fn`` runs on its own event loop,
SIGTERM cancels it the same way, and its outcome is the same
``(kind, payload)`` frame a local rank sends, so the supervisor builds the
same exceptions from it.

Nothing here is imported by ``import aiospawn``; Ray is imported by the caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import os
import pickle
import signal
import threading
from collections.abc import Mapping
from typing import Any

from aiospawn._core._env import free_port
from aiospawn._rank.outcome import die_of_sigterm, run_fn
from aiospawn._rank.wire import Kind, Outcome, encode_exception


class RankActor:
    """The Ray actor that runs one attempt at one rank (decorated with ``ray.remote`` later).

    Args:
        rank: The rank it runs, which names it in Ray's output prefix.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._done = threading.Event()

    def __repr__(self) -> str:
        # Ray prefixes each line a worker prints with its actor's repr:
        # "(rank3 pid=1234, ip=10.0.0.2) loss 0.5", as local ranks get "[rank3]: ".
        return f"rank{self._rank}"

    def describe(self) -> tuple[str, str, int]:
        """``(node_id, node_address, pid)`` of the process that will run the rank."""
        import ray

        context = ray.get_runtime_context()
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return context.get_node_id(), address, os.getpid()

    def free_port(self) -> int:
        """A TCP port nothing listens on, on this node (for ``MASTER_PORT``)."""
        return free_port(host="")

    def run(
        self,
        work: bytes,
        rank: int,
        env: Mapping[str, str],
        restart: int,
        board: Any,
        token: str,
        loop: str = "asyncio",
    ) -> Outcome:
        """Run the rank's ``fn`` on this (main) thread and return its outcome.

        Args:
            work: ``(fn, args)``, pickled by the supervisor (with cloudpickle,
                so ``fn`` may come from the driver's ``__main__``). Unpickled
                only here, once ``env`` is set, so that ``fn``'s module sees
                the rank's variables when it is imported, as under ``spawn``.
            rank: The rank's index.
            env: Variables to set first.
            restart: The attempt's restart count.
            board: The group's :class:`SignalBoard`.
            token: The group's token, which the board asks of every call.
            loop: The event loop an ``async def fn`` runs on.
        """
        from aiospawn._rank import api
        from aiospawn._rank.channel import open_channel

        from ._relay import RankRelay

        key = f"{rank}.{restart}"
        os.environ.update(env)
        # The rank's channel: the same rank-side end as a local rank's, relayed.
        relay = RankRelay(board, token, key)
        api.begin(restart=restart, frames=open_channel(relay.rank_fd))
        # Python's default action, as in a local rank: SIGTERM ends the process
        # unless fn installs a handler of its own.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(
            target=self._take_signals,
            args=(board, token, key),
            name="aiospawn-signals",
            daemon=True,
        ).start()
        terminated = False
        try:
            try:
                fn, args = pickle.loads(work)
            except BaseException as exc:
                error = RuntimeError(f"rank {rank} could not unpickle fn and args: {exc!r}")
                error.__cause__ = exc
                return Kind.RAISED, encode_exception(error), 1
            ending = run_fn(fn, rank, args, loop)
            terminated = ending.terminated
            return ending.frame
        finally:
            # What the rank sent and a cancellation left queued goes out first,
            # then through the board, before the supervisor learns of the end.
            api.end(CHANNEL_PATIENCE)
            relay.finish(CHANNEL_PATIENCE)
            self._done.set()
            if terminated:
                # SIGTERM cancelled an async fn, which ran its cleanup: the
                # process now dies of SIGTERM, as a local rank does.
                die_of_sigterm()

    def _take_signals(self, board: Any, token: str, key: str) -> None:
        import ray

        while not self._done.is_set():
            try:
                signum = ray.get(board.next_signal.remote(token, key))
            except Exception:  # the board is gone: the group is being torn down
                return
            # Checked here too: whatever reached the board, a rank only ever
            # takes the signals the supervisor sends.
            if signum in BOARD_SIGNALS and not self._done.is_set():
                with contextlib.suppress(OSError):
                    os.kill(os.getpid(), signum)


#: Seconds a rank's end waits for what it sent to reach the board.
CHANNEL_PATIENCE = 5.0


#: The signals the board carries: the supervisor's SIGTERM (SIGKILL is ray.kill).
BOARD_SIGNALS = frozenset({signal.SIGTERM})


#: Seconds a rank's signal thread waits on the board in one call.
SIGNAL_WAIT = 10.0

#: Bytes of channel frames the board holds per attempt and direction; a
#: ``put`` waits while this much is held (so one chunk more at most).
PIPE_BYTES = 1024 * 1024


class _Pipe:
    """One direction of one attempt's channel, held by the board: chunks of the frame stream."""

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.ended = False  # the writer said nothing more comes
        self.closed = False  # the channel was released: nothing is kept any more
        self.changed = asyncio.Condition()

    async def put(self, chunk: bytes) -> bool:
        async with self.changed:
            await self.changed.wait_for(lambda: self.size < PIPE_BYTES or self.closed)
            if self.closed or self.ended:
                return False
            self.chunks.append(chunk)
            self.size += len(chunk)
            self.changed.notify_all()
            return True

    async def take(self, wait: float) -> tuple[list[bytes], bool]:
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self.changed.wait_for(
                        lambda: bool(self.chunks) or self.ended or self.closed
                    )
            chunks = list(self.chunks)
            self.chunks.clear()
            self.size = 0
            self.changed.notify_all()
            return chunks, self.ended or self.closed

    async def end(self, close: bool) -> None:
        async with self.changed:
            self.ended = True
            if close:
                self.closed = True
                self.chunks.clear()
                self.size = 0
            self.changed.notify_all()


class SignalBoard:
    """Holds the signals sent to a group's ranks until each rank's thread takes them.

    And the frames of the ranks' channels, in both directions (:meth:`put`,
    :meth:`take`, :meth:`end`, :meth:`release`).

    Args:
        token: The group's secret; a call with another one is refused.
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self._queues: dict[str, asyncio.Queue[int]] = {}
        self._waiting: dict[str, int] = {}
        #: The channels of the attempts, by key, then direction ("up" is rank to supervisor).
        self._pipes: dict[str, dict[str, _Pipe]] = {}
        self._released: set[str] = set()  # keys whose channel is gone: never made again

    async def next_signal(self, token: str, key: str) -> int:
        """The next signal sent to the attempt ``key`` (``"rank.restart"``), or 0.

        0 after :data:`SIGNAL_WAIT` seconds without one: every waiting call
        ends in bounded time, also one whose rank was killed meanwhile, so the
        calls in flight stay about one per running rank.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        queue = self._queues.setdefault(key, asyncio.Queue())
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SIGNAL_WAIT):
                    return await queue.get()
            return 0
        finally:
            self._waiting[key] -= 1
            self._prune(key)

    async def send(self, token: str, key: str, signum: int) -> None:
        """Send ``signum`` to the attempt ``key``.

        Raises:
            PermissionError: ``token`` is not the group's.
            ValueError: ``signum`` is not one of :data:`BOARD_SIGNALS`.
        """
        self._check(token)
        if signum not in BOARD_SIGNALS:
            carried = ", ".join(signal.Signals(each).name for each in sorted(BOARD_SIGNALS))
            raise ValueError(f"the signal board carries {carried} only, got {signum!r}")
        self._queues.setdefault(key, asyncio.Queue()).put_nowait(signum)

    async def forget(self, token: str, key: str) -> None:
        """The attempt ``key`` is over: drop what was held for it.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        queue = self._queues.get(key)
        if queue is not None:
            while not queue.empty():
                queue.get_nowait()
            self._prune(key)

    async def put(self, token: str, key: str, direction: str, chunk: bytes) -> bool:
        """Add ``chunk`` to the frame stream ``direction`` of attempt ``key``'s channel.

        Waits while :data:`PIPE_BYTES` are held (back-pressure). False, and
        nothing kept, once the channel is released or that direction ended.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        pipe = self._pipe(key, direction)
        return False if pipe is None else await pipe.put(chunk)

    async def take(
        self, token: str, key: str, direction: str, wait: float
    ) -> tuple[list[bytes], bool]:
        """What is held in ``direction`` (waiting up to ``wait`` s for some), and whether it ended.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        pipe = self._pipe(key, direction)
        return ([], True) if pipe is None else await pipe.take(wait)

    async def end(self, token: str, key: str, direction: str) -> None:
        """Nothing more comes in ``direction``: its reader gets what is held, then the end.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        pipe = self._pipe(key, direction)
        if pipe is not None:
            await pipe.end(close=False)

    async def release(self, token: str, key: str) -> None:
        """Drop attempt ``key``'s channel; waiting calls on it return at once.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        self._released.add(key)
        for pipe in self._pipes.pop(key, {}).values():
            await pipe.end(close=True)

    async def keys(self, token: str) -> list[str]:
        """The attempts something is held or awaited for.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        return sorted({*self._queues, *self._pipes})

    def _check(self, token: str) -> None:
        if not (isinstance(token, str) and hmac.compare_digest(token, self._token)):
            raise PermissionError("this call does not carry the group's token")

    def _pipe(self, key: str, direction: str) -> _Pipe | None:
        if key in self._released or direction not in ("up", "down"):
            return None
        pipes = self._pipes.setdefault(key, {})
        return pipes.setdefault(direction, _Pipe())

    def _prune(self, key: str) -> None:
        # A queue nobody waits on and that holds nothing is recreated on demand.
        queue = self._queues.get(key)
        if queue is not None and queue.empty() and not self._waiting.get(key):
            del self._queues[key]
            self._waiting.pop(key, None)
