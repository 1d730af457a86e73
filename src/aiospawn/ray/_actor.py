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

The outcome of ``fn`` is the same ``(kind, payload)`` frame a local rank
sends (see ``aiospawn._rank.wire``), so the supervisor builds the same exceptions from it.

Nothing here is imported by ``import aiospawn``; Ray is imported by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
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
        token: str,
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
        """
        from aiospawn._rank import api

        os.environ.update(env)
        api._restart = restart  # what aiospawn.restart_count() answers in the rank
        # Python's default action, as in a local rank: SIGTERM ends the process
        # unless fn installs a handler of its own.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(
            target=self._take_signals,
            args=(board, token, f"{rank}.{restart}"),
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


#: The signals the board carries: the supervisor's SIGTERM (SIGKILL is ray.kill).
BOARD_SIGNALS = frozenset({signal.SIGTERM})


#: Seconds a rank's signal thread waits on the board in one call.
SIGNAL_WAIT = 10.0


class SignalBoard:
    """Holds the signals sent to a group's ranks until each rank's thread takes them.

    Args:
        token: The group's secret; a call with another one is refused.
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self._queues: dict[str, asyncio.Queue[int]] = {}
        self._waiting: dict[str, int] = {}

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

    async def keys(self, token: str) -> list[str]:
        """The attempts something is held or awaited for.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        return sorted(self._queues)

    def _check(self, token: str) -> None:
        if not (isinstance(token, str) and hmac.compare_digest(token, self._token)):
            raise PermissionError("this call does not carry the group's token")

    def _prune(self, key: str) -> None:
        # A queue nobody waits on and that holds nothing is recreated on demand.
        queue = self._queues.get(key)
        if queue is not None and queue.empty() and not self._waiting.get(key):
            del self._queues[key]
            self._waiting.pop(key, None)
