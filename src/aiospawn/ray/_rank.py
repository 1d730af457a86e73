"""One rank attempt run by a Ray actor: its sentinel, its stop signals, its exit.

The actor's ``run()`` result is the rank's sentinel (see ``_bridge``): one
task waits on it, the others for that one (``SingleWatcher``), as
``LocalRank.wait`` does. How the call ended becomes the same
:class:`~aiospawn._core._outcome.RankExit` a local rank makes: ``fn``'s own
frame when it returned, raised or called ``sys.exit()``; a worker process or
node that died becomes an ``EXITED`` frame saying so, with Ray's account of it
as the exit's note.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._concurrency import SingleWatcher
from aiospawn._core._outcome import RankExit
from aiospawn._rank.wire import Kind, encode_exception

from ._bridge import done_event
from ._link import RayLink

#: Seconds an ended rank's exit waits for its channel's last frames from the board.
DRAIN_PATIENCE = 10.0


class RayRank:
    """One attempt at one rank, run by a Ray actor (see ``_backend.RankHandle``).

    Args:
        index: The rank.
        restart: The attempt number.
        ray: The ``ray`` module (imported by the launcher, never here).
        post: Posts a signal for the rank's process on the group's board,
            ``post(key, signum)``.
        forget: Tells the board the attempt is over, ``forget(key)``.
        link: The attempt's channel, over the group's board (``_link``).
    """

    def __init__(
        self,
        index: int,
        restart: int,
        *,
        ray: Any,
        post: Callable[[str, int], None],
        forget: Callable[[str], None],
        link: RayLink,
    ) -> None:
        self._ray = ray
        self._post = post
        self._forget = forget
        self.rank = index
        self.link = link
        self.restart = restart
        self._key = f"{index}.{restart}"
        self.actor: Any = None
        self._future: Future[Any] | None = None
        self._pid: int | None = None
        self._node: tuple[str, str] | None = None
        self._exit: RankExit | None = None
        self._stopped_by_us = False
        self._last_signal: int | None = None
        self._watcher = SingleWatcher()
        self._done = anyio.Event()  # replaced in begin()

    @property
    def started(self) -> bool:
        """True once ``fn`` has been handed to the rank's actor."""
        return self._future is not None

    @property
    def pid(self) -> int | None:
        """The pid of the actor's worker process, on its node."""
        return self._pid

    @property
    def node(self) -> tuple[str, str] | None:
        """``(node_id, address)`` of the node the rank runs on, once started."""
        return self._node

    @property
    def exit(self) -> RankExit | None:
        """How the attempt ended, once its actor's ``run()`` has finished."""
        return self._exit

    def described(self, description: tuple[str, str, int]) -> None:
        """Record what the actor told about itself before it runs ``fn``."""
        node_id, address, pid = description
        self._node, self._pid = (node_id, address), pid

    def begin(
        self, work: Any, env: dict[str, str], board: Any, address: str, token: str, loop: str
    ) -> None:
        """Submit ``run()``; its result is the rank's sentinel. On the event loop.

        Args:
            work: The object reference of ``(fn, args)``, pickled.
            env: The rank's environment.
            board: The board on the rank's node.
            address: The board's socket, which the rank's channel connects to.
            token: The group's token.
            loop: The event loop of an ``async def fn``.
        """
        ref = self.actor.run.remote(work, self.rank, env, self.restart, board, token, loop, address)
        self._future = ref.future()
        # One wake-up per attempt, however often the rank is waited for.
        self._done = done_event(self._future)
        self.link.attach(self._future, board, token)

    def exited(self) -> bool:
        """True once the rank's ``run()`` has finished. Changes nothing."""
        return self._exit is not None or (self._future is not None and self._future.done())

    def poll(self) -> RankExit | None:
        """Return the exit if ``run()`` has finished, without waiting.

        The exit is known once the channel holds everything the rank sent
        (:attr:`RayLink.drained`, shortly after ``run()``): as for a local
        rank, what it sent before it exited can still be received.
        """
        if (
            self._exit is None
            and self._future is not None
            and self._future.done()
            and self.link.drained.is_set()
        ):
            self._finish(self._future)
        return self._exit

    async def wait(self) -> RankExit:
        """Wait for the exit. Several tasks may call this at once; one watches."""
        if self._future is None:
            raise RuntimeError(f"rank {self.rank} has not been started")
        await self._watcher.run(lambda: self.poll() is not None, self._wait_done)
        await checkpoint()
        assert self._exit is not None
        return self._exit

    async def _wait_done(self) -> None:
        await self._done.wait()
        with anyio.move_on_after(DRAIN_PATIENCE):
            await self.link.drained.wait()
        self.link.stop_draining()  # a no-op once drained

    def discard(self) -> None:
        """Nothing to release before the actor exists."""

    def send_signal(self, signum: int) -> bool:
        """``SIGKILL``: ``ray.kill`` the actor; other signals go to the rank's process.

        Returns False, and does nothing, if the rank is not running.
        """
        if not self.started or self.poll() is not None:
            return False
        self._stopped_by_us = True
        self._last_signal = signum
        if signum == signal.SIGKILL:
            self._ray.kill(self.actor, no_restart=True)
        else:
            self._post(self._key, signum)
        return True

    def _finish(self, future: Future[Any]) -> None:
        ray = self._ray
        pid = self._pid if self._pid is not None else 0
        where = self._where()
        frame: tuple[int, bytes] | None
        try:
            kind, payload, exit_code = future.result()
            frame = (kind, payload)
            note = None if kind == Kind.RETURNED else f"the rank ran {where}"
        except ray.exceptions.RayActorError as exc:
            exit_code = self._death_code(exc)
            frame = self._death_frame(exc, exit_code)
            note = self._death_note(exc, where)
        except ray.exceptions.RayTaskError as exc:
            # Raised outside fn: the arguments could not be unpickled there, say.
            frame = (Kind.RAISED, encode_exception(exc.cause or exc, str(exc)))
            exit_code = 1
            note = f"the rank ran {where}"
        except Exception as exc:  # another Ray error: the object was lost, say
            frame = (Kind.RAISED, encode_exception(exc, f"{type(exc).__name__}: {exc}\n"))
            exit_code = 1
            note = f"the rank ran {where}"
        self._exit = RankExit(
            rank=self.rank,
            pid=pid,
            exit_code=exit_code,
            frame=frame,
            stopped_by_us=self._stopped_by_us,
            note=note,
            # When the supervisor learnt of the end: a Ray rank does not
            # send its own time, whose clock may be another machine's.
            ended_at=time.time(),
        )
        # The rank is over; its worker process and resources go back to Ray,
        # as a local rank's process exits. (Submits the kill; does not wait.)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._forget(self._key)

    def _where(self) -> str:
        if self._node is None:
            return "on Ray"
        node_id, address = self._node
        return f"on Ray node {address} (node id {node_id[:12]}, worker pid {self._pid})"

    def _death_code(self, exc: BaseException) -> int:
        # Ray 2.60 words an orderly worker exit "... exits with an exit code N".
        match = re.search(r"exits with an exit code (\d+)", str(exc))
        if match:
            return int(match.group(1))
        if self._stopped_by_us and self._last_signal is not None:
            return -self._last_signal
        # Ray does not report how a worker process died abruptly (its own text
        # lists the out-of-memory killer, SIGSEGV and `ray stop --force`).
        return -signal.SIGKILL

    def _death_frame(self, exc: BaseException, exit_code: int) -> tuple[int, bytes] | None:
        """Say what Ray knows of a death we did not cause, as a sys.exit() text would."""
        if self._stopped_by_us:
            return None
        if _node_died(exc):
            detail = "its Ray node died or was lost (Ray's health checks failed)"
        elif exit_code == -signal.SIGKILL:
            detail = (
                "its Ray worker process died, and Ray does not report how; SIGKILL"
                " stands in for its exit status"
            )
        else:
            detail = "its Ray worker process exited"
        return Kind.EXITED, pickle.dumps((exit_code, detail))

    def _death_note(self, exc: BaseException, where: str) -> str:
        if self._stopped_by_us:
            return f"the rank ran {where}"
        return f"the rank ran {where}. Ray says:\n{str(exc).strip()}"


def _node_died(exc: BaseException) -> bool:
    text = str(exc)
    return "node has died" in text or "node died" in text or "node was" in text
