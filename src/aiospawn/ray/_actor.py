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

The outcome of ``fn`` is the same ``(kind, payload)`` frame a local rank
sends (see ``aiospawn._rank.wire``), so the supervisor builds the same exceptions from it.

Nothing here is imported by ``import aiospawn``; Ray is imported by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Mapping
from typing import Any

from aiospawn._core._env import free_port
from aiospawn._rank.wire import Kind, Outcome, encode_exception
from aiospawn._rank.wire import call as call_rank


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
        """
        from aiospawn._rank import api

        os.environ.update(env)
        api._restart = restart  # what aiospawn.restart_count() answers in the rank
        # Python's default action, as in a local rank: SIGTERM ends the process
        # unless fn installs a handler of its own.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(
            target=self._take_signals,
            args=(board, f"{rank}.{restart}"),
            name="aiospawn-signals",
            daemon=True,
        ).start()
        try:
            try:
                fn, args = pickle.loads(work)
            except BaseException as exc:
                error = RuntimeError(f"rank {rank} could not unpickle fn and args: {exc!r}")
                error.__cause__ = exc
                return Kind.RAISED, encode_exception(error), 1
            return call_rank(fn, rank, args)
        finally:
            self._done.set()

    def _take_signals(self, board: Any, key: str) -> None:
        import ray

        while not self._done.is_set():
            try:
                signum = ray.get(board.next_signal.remote(key))
            except Exception:  # the board is gone: the group is being torn down
                return
            if signum and not self._done.is_set():
                with contextlib.suppress(OSError):
                    os.kill(os.getpid(), signum)


#: Seconds a rank's signal thread waits on the board in one call.
SIGNAL_WAIT = 10.0


class SignalBoard:
    """Holds the signals sent to a group's ranks until each rank's thread takes them."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[int]] = {}

    def _queue(self, key: str) -> asyncio.Queue[int]:
        return self._queues.setdefault(key, asyncio.Queue())

    async def next_signal(self, key: str) -> int:
        """The next signal sent to the attempt ``key`` (``"rank.restart"``), or 0.

        0 after :data:`SIGNAL_WAIT` seconds without one: every waiting call
        ends in bounded time, also one whose rank was killed meanwhile, so the
        calls in flight stay about one per running rank.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SIGNAL_WAIT):
                return await self._queue(key).get()
        return 0

    async def send(self, key: str, signum: int) -> None:
        """Send ``signum`` to the attempt ``key``."""
        self._queue(key).put_nowait(signum)
