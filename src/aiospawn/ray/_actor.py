"""What runs a rank on the Ray cluster: one actor per rank attempt.

A rank is a plain (synchronous) Ray actor, so ``fn`` runs on the main thread
of the actor's worker process, as it does in a local rank: it may install
signal handlers, and ``SIGTERM`` gets its default action back before ``fn``
runs (Ray's worker replaces it with one that raises ``SystemExit``).

A plain actor answers one call at a time, so while ``fn`` runs it cannot take
a "please stop" call. The group's board on the rank's node
(``_board.SignalBoard``) carries signals instead: a thread in each rank waits on the board and
delivers what arrives to its own process with ``os.kill``, and Python's (or
the user's) handler runs as it would locally; the rank takes only the signals
the board carries (``_board.BOARD_SIGNALS``). ``SIGKILL`` never goes through
the board: the supervisor uses ``ray.kill``. Ray kills an actor whose owner
(the supervising process) dies, which is the cluster's parent-death guard.

The rank's channel (``aiospawn.channel()``, ``ctx.channel(rank)``) is a Unix
socket to the same board, which the rank connects on its node: the rank
actor cannot take calls of its own while ``fn`` runs, and ``_relay`` has the
picture. ``fn`` runs under the same rule as a local rank's
(``aiospawn._rank.outcome``): an ``async def fn`` runs on its own event loop,
SIGTERM cancels it the same way, and its outcome is the same
``(kind, payload)`` frame a local rank sends, so the supervisor builds the
same exceptions from it.

Nothing here is imported by ``import aiospawn``; Ray is imported by the caller.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Mapping
from typing import Any

from aiospawn._core._env import free_port
from aiospawn._rank.outcome import die_of_sigterm, run_fn
from aiospawn._rank.wire import Kind, Outcome, encode_exception

from ._board import BOARD_SIGNALS


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
        address: str = "",
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
            board: The group's :class:`SignalBoard` on this node.
            token: The group's token, which the board asks of every call.
            loop: The event loop an ``async def fn`` runs on.
            address: The board's socket, which the rank's channel connects to.
        """
        from aiospawn._rank import api
        from aiospawn._rank.frames import open_channel

        from ._relay import connect

        key = f"{rank}.{restart}"
        os.environ.update(env)
        # The rank's channel: the same rank-side end as a local rank's, over a
        # socket to the board on this node.
        api.begin(restart=restart, frames=open_channel(connect(address, token, key)))
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
            # What the rank sent and a cancellation left queued goes out to the
            # board before the supervisor learns of the end.
            api.end(CHANNEL_PATIENCE)
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


#: Seconds a rank's end waits for what it sent to reach its socket.
CHANNEL_PATIENCE = 5.0
