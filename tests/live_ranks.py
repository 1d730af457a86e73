"""Ranks for test_live: async rank functions, readiness, channels and collective calls.

Each is called as ``fn(rank, *args)``; importable, so that spawn and
forkserver ranks reach them. Names ending in ``_async`` are ``async def``
and run on the rank's own loop (asyncio or trio, the group's ``rank_loop``);
they use anyio, which runs on either.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

import aiospawn

#: ``(reader, writer)`` of a ``multiprocessing.Pipe(duplex=False)``.
Pipe = tuple[Connection, Connection]


def loop_name() -> str:
    """The event loop running this rank's ``async def fn``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "trio" if "trio" in sys.modules else "none"
    return "asyncio"


# ------------------------------------------------------------ async fn


async def return_async(rank: int, value: Any) -> tuple[int, Any, str]:
    await anyio.lowlevel.checkpoint()
    return rank, value, loop_name()


class RankError(Exception):
    """Raised by a rank, to be recognised by type and text."""


async def raise_async(rank: int, failing: int) -> None:
    await anyio.lowlevel.checkpoint()
    if rank == failing:
        raise RankError(f"raised in async rank {rank}")
    await anyio.sleep(3600)  # stopped by the supervisor once the other rank failed


async def clean_up_async(rank: int, report: Connection) -> None:
    """Say ready, wait in receive() to be stopped; the ``finally`` reports the cleanup."""
    try:
        aiospawn.ready(os.getpid())
        await aiospawn.channel().receive()  # SIGTERM cancels it: nothing is sent
    finally:
        # An await in the cleanup works too (shielded: trio re-raises Cancelled
        # at any checkpoint of a cancelled scope).
        with anyio.CancelScope(shield=True):
            await anyio.lowlevel.checkpoint()
        report.send(("cleaned", rank, os.getpid(), loop_name()))


# ------------------------------------------------------------- readiness


def _drain_sync() -> None:
    for _ in aiospawn.channel():  # until the supervisor closes the channel
        pass


async def _drain_async() -> None:
    async for _ in aiospawn.channel():
        pass


def ready_then_drain(rank: int) -> int:
    aiospawn.ready({"rank": rank, "pid": os.getpid(), "restart": aiospawn.restart_count()})
    _drain_sync()
    return rank


async def ready_then_drain_async(rank: int) -> int:
    aiospawn.ready({"rank": rank, "loop": loop_name()})
    await _drain_async()
    return rank


def fail_before_ready(rank: int, failing: int) -> None:
    if rank == failing:
        raise RankError(f"rank {rank} failed before it was ready")
    ready_then_drain(rank)


def never_ready(rank: int, late: int) -> None:
    """Every rank but ``late`` says ready; ``late`` beats (so it is not hung), never ready."""
    if rank != late:
        aiospawn.ready(rank)
    else:
        aiospawn.heartbeat()
    _drain_sync()


def ready_after_restart(rank: int, first_ready: Pipe, restarted: Pipe) -> None:
    """Rank 1's first attempt says ready and dies; rank 0 is ready only once it is back.

    Rank 1's second attempt says ready only after rank 0 is: so a supervisor
    that counted the dead attempt's readiness would return before it.
    Each pipe is ``(reader, writer)``.
    """
    attempt = aiospawn.restart_count()
    if rank == 1 and attempt == 0:
        aiospawn.ready(("rank 1", attempt))
        os._exit(3)
    if rank == 1:
        restarted[1].send("rank 1 is back")
        first_ready[0].recv()  # rank 0 is ready now
        aiospawn.ready(("rank 1", attempt))
    else:
        restarted[0].recv()  # rank 1's second attempt runs
        aiospawn.ready(("rank 0", attempt))
        first_ready[1].send("rank 0 is ready")
    _drain_sync()


# -------------------------------------------------------------- channels


def echo(rank: int) -> int:
    """Send back ``(rank, message)`` for each message; return how many."""
    channel = aiospawn.channel()
    count = 0
    for message in channel:
        channel.send((rank, message))
        count += 1
    return count


async def echo_async(rank: int) -> int:
    channel = aiospawn.channel()
    count = 0
    async for message in channel:
        await channel.send((rank, message))
        count += 1
    return count


def send_then_end(rank: int, count: int, how: str, release: Connection | None) -> None:
    """Send ``0..count-1``, then return, or close the channel and return once released."""
    channel = aiospawn.channel()
    for seq in range(count):
        channel.send(seq)
    if how == "close":
        channel.close()
        assert release is not None
        release.recv()


async def send_then_end_async(rank: int, count: int, how: str, release: Connection | None) -> None:
    channel = aiospawn.channel()
    for seq in range(count):
        await channel.send(seq)
    if how == "close":
        await channel.aclose()
        assert release is not None
        await anyio.to_thread.run_sync(release.recv)


def read_when_told(rank: int, go: Connection) -> tuple[int, list[int]]:
    """Read nothing until told; then read until the supervisor closes the channel."""
    go.recv()
    channel = aiospawn.channel()
    sizes, seqs = [], []
    for seq, payload in channel:
        seqs.append(seq)
        sizes.append(len(payload))
    return len(set(sizes)), seqs


def die_when_told(rank: int, dying: int, go: Connection) -> None:
    aiospawn.ready()
    if rank == dying:
        go.recv()
        os._exit(7)
    _drain_sync()


def receive_one_after_close(rank: int) -> str:
    """Wait for the supervisor to close; then a send must fail."""
    channel = aiospawn.channel()
    for _ in channel:
        pass
    try:
        channel.send("too late")
    except BrokenPipeError:
        return "send refused"
    return "sent"


def first_message_per_attempt(rank: int, die: Connection) -> None:
    """Every attempt says ready; attempt 0 of rank 1 dies when told, reading nothing.

    Later attempts send back the first message they receive.
    """
    attempt = aiospawn.restart_count()
    aiospawn.ready(attempt)
    channel = aiospawn.channel()
    if rank == 1 and attempt == 0:
        die.recv()
        os._exit(3)
    for message in channel:
        channel.send((attempt, message))


# ------------------------------------------------------------------ calls


class Unpicklable(Exception):
    """An exception whose pickle cannot be loaded: ``__init__`` needs two arguments."""

    def __init__(self, text: str, rank: int) -> None:
        super().__init__(f"{text} on rank {rank}")


class Handler:
    """What the collective-call ranks serve (sync methods)."""

    def __init__(self, rank: int, hold: Connection | None = None) -> None:
        self.rank = rank
        self._hold = hold

    def whoami(self) -> int:
        return self.rank

    def add(self, a: int, b: int = 0) -> tuple[int, int]:
        return self.rank, a + b

    def fail(self, failing: list[int]) -> int:
        if self.rank in failing:
            raise RankError(f"handler failed on rank {self.rank}")
        return self.rank

    def die(self, dying: int) -> int:
        if self.rank == dying:
            os._exit(9)
        return self.rank

    def blob(self, size: int) -> bytes:
        return bytes([self.rank]) * size

    def length(self, data: bytes) -> tuple[int, int]:
        return len(data), data[-1]

    async def awaited(self) -> int:
        return self.rank

    def unpicklable(self) -> Any:
        return lambda: None

    def raise_unpicklable(self) -> None:
        raise Unpicklable("the handler's own error", self.rank)

    def hold(self, holding: int) -> int:
        """On rank ``holding``, answer only once the test says so."""
        if self.rank == holding:
            assert self._hold is not None
            self._hold.recv()
        return self.rank


class AsyncHandler:
    """The same methods, ``async def``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    async def whoami(self) -> int:
        await anyio.lowlevel.checkpoint()
        return self.rank

    async def add(self, a: int, b: int = 0) -> tuple[int, int]:
        await anyio.lowlevel.checkpoint()
        return self.rank, a + b

    async def fail(self, failing: list[int]) -> int:
        await anyio.lowlevel.checkpoint()
        if self.rank in failing:
            raise RankError(f"handler failed on rank {self.rank}")
        return self.rank

    async def die(self, dying: int) -> int:
        if self.rank == dying:
            os._exit(9)
        return self.rank


def serve(rank: int, hold: Connection | None = None) -> str:
    aiospawn.ready()
    aiospawn.serve(Handler(rank, hold))
    return "served"


async def serve_async(rank: int) -> str:
    aiospawn.ready()
    await aiospawn.serve(AsyncHandler(rank))
    return "served"


class Overlapping:
    """``async def`` methods that show whether calls overlap, and whether they are cancelled."""

    def __init__(self, rank: int, report: Connection) -> None:
        self.rank = rank
        self._report = report
        self._arrived = 0
        self._everyone = anyio.Event()

    async def meet(self, meeting: int) -> int:
        """Return once ``meeting`` calls are here: calls that do not overlap never get past."""
        self._arrived += 1
        if self._arrived == meeting:
            self._everyone.set()
        await self._everyone.wait()
        return self.rank

    async def hang(self, name: str) -> None:
        """Report, then wait until cancelled; report the cleanup."""
        try:
            self._report.send(("started", name, self.rank))
            await anyio.sleep_forever()
        finally:
            self._report.send(("cleaned up", name, self.rank))

    async def whoami(self) -> int:
        await anyio.lowlevel.checkpoint()
        return self.rank


async def serve_overlapping_async(rank: int, report: Connection, limit: int | None) -> str:
    aiospawn.ready()
    await aiospawn.serve(Overlapping(rank, report), limit=limit)
    return "served"


class Holding:
    """Sync methods: one that holds the rank until the test releases it, one that records."""

    def __init__(self, report: Connection, release: Connection) -> None:
        self._report = report
        self._release = release
        self.recorded: list[str] = []

    def hold(self, name: str) -> str:
        self._report.send(("started", name))
        self._release.recv()
        self._report.send(("ran to its end", name))
        return name

    def record(self, name: str) -> list[str]:
        self.recorded.append(name)
        return self.recorded


def serve_holding(rank: int, report: Connection, release: Connection) -> str:
    aiospawn.ready()
    aiospawn.serve(Holding(report, release))
    return "served"


def send_then_raise(rank: int, count: int) -> None:
    channel = aiospawn.channel()
    for seq in range(count):
        channel.send(seq)
    raise RankError(f"rank {rank} raised after {count} messages")


def _deadlines(seed: int, count: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.choice([0.0, rng.uniform(0, 0.002)]) for _ in range(count)]


async def storm_in_rank_async(rank: int, count: int) -> None:
    """Cancel the rank's own receive() and send() at random points; report what got through.

    Receives ``count`` messages, each receive under a tiny deadline, retried
    until it gets one; sends back each one it got. Then sends ``count``
    sequence numbers, each send under a tiny deadline, and last
    ``("sent", [the seqs whose send completed])``.
    """
    channel = aiospawn.channel()
    received = []
    for deadline in _deadlines(rank, 10 * count):
        if len(received) == count:
            break
        with anyio.move_on_after(deadline):
            received.append(await channel.receive())
    while len(received) < count:
        received.append(await channel.receive())
    await channel.send(("received", received))
    completed = []
    for seq, deadline in enumerate(_deadlines(rank + 1, count)):
        with anyio.move_on_after(deadline):
            await channel.send((seq, b"r" * (seq % 5 * 50_000)))
            completed.append(seq)
    await channel.send(("sent", completed))
    await _drain_async()


def return_at_once(rank: int) -> int:
    return rank


async def stuck_in_cleanup_async(rank: int, report: Connection) -> None:
    """Say ready; once cancelled, report and block in the cleanup (a 2nd SIGTERM must end it)."""
    try:
        aiospawn.ready(os.getpid())
        await anyio.sleep(3600)
    finally:
        report.send(("in cleanup", rank))
        with anyio.CancelScope(shield=True):
            await anyio.sleep(3600)
        report.send(("cleanup finished", rank))  # never: the second SIGTERM kills it


def sized(seq: int) -> bytes:
    """Message ``seq``'s payload: some above the supervisor's decode-on-a-thread size."""
    return bytes([seq % 256]) * (seq % 4 * 150_000)


def send_sized(rank: int, count: int) -> None:
    channel = aiospawn.channel()
    for seq in range(count):
        channel.send((seq, sized(seq)))


async def send_sized_async(rank: int, count: int) -> None:
    channel = aiospawn.channel()
    for seq in range(count):
        await channel.send((seq, sized(seq)))


async def serve_while_sending_async(rank: int, count: int) -> None:
    """Serve calls in one task while another streams ``count`` large messages."""
    channel = aiospawn.channel()

    async def stream() -> None:
        for seq in range(count):
            await channel.send((seq, b"m" * 200_000))
        await channel.send(("done", b""))

    async with anyio.create_task_group() as tg:
        tg.start_soon(stream)
        await aiospawn.serve(AsyncHandler(rank))
