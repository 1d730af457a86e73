"""Helpers shared by the tests: the ranks' report pipe, tripwires, checks on processes and fds.

Fixtures live in ``conftest.py``; everything else the tests share is here,
also the send storm that the local and the Ray channel tests both run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import psutil
import pytest

if TYPE_CHECKING:
    from aiospawn import AsyncProcessContext, RankChannel

#: ``(reader, writer)``: the test reads the first end, the ranks write to the second.
Events = tuple[Connection, Connection]


@contextmanager
def tripwire(seconds: float, what: str) -> Iterator[None]:
    """Fail (rather than hang) if the block takes ``seconds``: something deadlocked."""
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        pytest.fail(f"deadlock: {what} did not finish within {seconds} s")


async def receive(reader: Connection, what: str, seconds: float = 30.0) -> Any:
    """Read one message the ranks sent; fail, rather than hang, if none comes in time."""
    if not await anyio.to_thread.run_sync(reader.poll, seconds):
        pytest.fail(f"no {what} from the ranks within {seconds} s")
    return reader.recv()


async def wait_exits_seen(ctx: AsyncProcessContext[Any], *ranks: int) -> None:
    """Wait until the group's owner has seen ``ranks`` exit (nobody joins meanwhile)."""
    import aiospawn

    waiting = set(ranks)
    async with contextlib.aclosing(ctx.events()) as events:
        async for event in events:
            if isinstance(event, aiospawn.Exited):
                waiting.discard(event.rank)
                if not waiting:
                    return


async def receive_ready(reader: Connection, nprocs: int) -> dict[int, int]:
    """Wait until ``nprocs`` ranks sent ``("ready", rank, pid)``; return pid by rank."""
    pids = {}
    for _ in range(nprocs):
        kind, rank, pid = await receive(reader, "ready message")
        assert kind == "ready"
        pids[rank] = pid
    return pids


async def cancel_once_ready(
    call: Callable[[], Awaitable[object]], reader: Connection, nprocs: int
) -> dict[int, int]:
    """Run ``call()`` in a task, cancel it once ``nprocs`` ranks said ready; return their pids.

    The scaffold of the cancellation tests: the cancellation comes only when
    the ranks are running and the call is blocked, and the call must end by
    that cancellation (not by finishing first, not by an error).
    """
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await call()
        assert scope.cancelled_caught, "the call ended before it was cancelled"

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        pids = await receive_ready(reader, nprocs)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
    return pids


class ImportGate:
    """Holds the imports of ``tests.warm_modules.gated`` until the test opens it.

    The module connects to this gate's listening socket as its import begins
    (:meth:`entered` accepts it: the handshake) and waits until the test
    closes that connection. :meth:`open` lets every held import end, and
    every later one pass at once (nobody listens any more).
    """

    def __init__(self, listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
        self._listener = listener
        self._held: list[anyio.abc.SocketStream] = []
        self._opened = anyio.Event()
        #: True once :meth:`open` was called.
        self.is_open = False

    async def entered(self, seconds: float = 30.0) -> None:
        """Wait until an import reaches the gate; fail if none does within ``seconds``."""
        with tripwire(seconds, "an import reaching the gate"):
            self._held.append(await self._listener.accept())

    async def open(self) -> None:
        """Let the held imports end, and those to come pass."""
        self.is_open = True
        self._opened.set()
        await self._listener.aclose()
        for connection in self._held:
            await connection.aclose()
        self._held.clear()

    async def open_after(self, seconds: float) -> None:
        """A tripwire: open the gate after ``seconds``, so that code waiting for it unwinds.

        Returns early once the gate is open.
        """
        with anyio.move_on_after(seconds):
            await self._opened.wait()
        await self.open()


def first_frame(traceback_text: str) -> str:
    """The outermost frame of the last traceback in a formatted one (past those it chains)."""
    return traceback_text.rpartition("Traceback (most recent call last):\n")[2].splitlines()[0]


def drain(reader: Connection) -> list[Any]:
    """Everything the ranks sent that has not been read yet."""
    messages = []
    while reader.poll(0):
        messages.append(reader.recv())
    return messages


def is_reaped(pid: int) -> bool:
    """True once ``pid`` has exited and been reaped: a zombie still exists.

    For our own ranks, which aiospawn must reap before its call returns.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def is_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs: no such process, or a zombie.

    For processes that are not our children (a launcher's ranks, a rank's
    children), whose reaping is somebody else's.
    """
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def is_running(pid: int) -> bool:
    """True if ``pid`` is a live process (a zombie is dead)."""
    return not is_gone(pid)


def open_fds() -> set[str]:
    """Descriptors of the kinds aiospawn opens: pipes and pidfds, as fd:target."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own fd, closed meanwhile
            continue
        if target.startswith("pipe:") or target == "anon_inode:[pidfd]":
            fds.add(f"{name}:{target}")
    return fds


def live_children() -> set[int]:
    """Pids of this process's descendants, zombies included."""
    return {child.pid for child in psutil.Process().children(recursive=True)}


def wait_exited(pids: Sequence[int], seconds: float = 60.0) -> None:
    """Block until every pid has exited, without reaping any (a zombie has exited).

    A pidfd becomes readable when its process exits, reaped or not: the
    supervisor then finds every exit at its next poll.
    """
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited, and reaped by its group's owner already
            continue
        try:
            ready, _, _ = select.select([fd], [], [], seconds)
        finally:
            os.close(fd)
        if not ready:
            pytest.fail(f"deadlock: pid {pid} did not exit within {seconds} s")


def wait_until(predicate: object, seconds: float = 5.0) -> bool:
    """Retry ``predicate()`` briefly: the kernel finishes some exits a moment later."""
    assert callable(predicate)
    deadline = time.monotonic() + seconds
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


async def send_storm(
    channel: RankChannel, deadlines: Sequence[float], size: Callable[[int], int]
) -> tuple[list[int], list[int]]:
    """Send ``(seq, payload)`` to an echoing rank 0, each under its deadline, then ``("end", b"")``.

    The rank's echoes are read all along (a rank blocked sending them would stop
    reading), each checked for its rank and size. Each message must arrive
    whole, once and in order; a cancelled send may or may not have gone.

    Returns:
        The sequence numbers whose send completed, and those echoed back.
    """
    completed: list[int] = []
    echoed: list[int] = []

    async def read_echoes() -> None:
        while (message := await channel.receive())[1][0] != "end":
            rank, (seq, payload) = message
            assert (rank, len(payload)) == (0, size(seq))
            echoed.append(seq)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_echoes)
        for seq, deadline in enumerate(deadlines):
            with anyio.move_on_after(deadline):
                await channel.send((seq, b"s" * size(seq)))
                completed.append(seq)
        await channel.send(("end", b""))
    assert echoed == sorted(set(echoed))
    assert set(completed) <= set(echoed)
    assert completed, "every send was cancelled: the storm tested nothing"
    return completed, echoed


class Recorder(logging.Handler):
    """A logging handler that keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def recorders(*names: str) -> Iterator[dict[str, Recorder]]:
    """A :class:`Recorder` on each named logger ("" is the root), removed afterwards.

    Unlike pytest's ``caplog``, whose handler is the root logger's, this shows
    which loggers a record reached, as ``assertLogs("torch")`` in torch's tests does.
    """
    attached = {name: Recorder() for name in names}
    for name, handler in attached.items():
        logging.getLogger(name or None).addHandler(handler)
    try:
        yield attached
    finally:
        for name, handler in attached.items():
            logging.getLogger(name or None).removeHandler(handler)
