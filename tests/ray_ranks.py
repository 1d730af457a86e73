"""Rank functions for the Ray backend's tests and benchmark (imported by the ranks).

Standard library only at the top: the benchmark runs them as local ranks too,
which must not pay for importing Ray.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any


def square(rank: int, base: int = 0) -> int:
    return base + rank * rank


def environment(rank: int, names: tuple[str, ...]) -> dict[str, Any]:
    """What the rank sees: the named variables, its node and pid."""
    import ray

    return {
        "env": {name: os.environ.get(name) for name in names},
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
    }


def fail_rank(rank: int, bad: int) -> None:
    """Rank ``bad`` raises at once; the others wait to be stopped."""
    if rank == bad:
        raise ValueError(f"bad shard {rank}")
    time.sleep(600)


def exit_with(rank: int, code: int) -> None:
    """Every rank calls sys.exit(code)."""
    raise SystemExit(code)


def report_ready(rank: int, port: int) -> None:
    """Tell the test (listening on ``port`` on this machine) that ``rank`` is running."""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(b"%d\n" % rank)


def sleep_forever(rank: int, port: int) -> None:
    """Report (unless ``port`` is 0), then sleep until stopped."""
    if port:
        report_ready(rank, port)
    time.sleep(600)


def ignore_sigterm(rank: int, port: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report_ready(rank, port)
    time.sleep(600)


def flaky(rank: int, hold: bool) -> tuple[int, int]:
    """Rank 1 fails in its first attempt; every attempt returns (rank, restart).

    With ``hold``, rank 0's first attempt runs until it is stopped.
    """
    import aiospawn

    restart = aiospawn.restart_count()
    if rank == 1 and restart == 0:
        raise RuntimeError("first attempt fails")
    if hold and rank == 0 and restart == 0:
        time.sleep(600)
    return rank, restart


def handle_sigterm(rank: int, port: int) -> None:
    """Turn SIGTERM into SystemExit(7), as a rank with cleanup to do would."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(7)

    signal.signal(signal.SIGTERM, stop)
    report_ready(rank, port)
    time.sleep(600)


def entry_stamp(rank: int) -> float:
    """``time.monotonic()`` at the rank's entry (system-wide on Linux)."""
    return time.monotonic()


def stamp_and_fail(rank: int, bad: int, port: int | None = None) -> None:
    """Rank ``bad`` raises at once, carrying the monotonic time it raised at."""
    if rank == bad:
        raise ValueError(time.monotonic())
    time.sleep(600)


def imported_with(rank: int, name: str) -> str | None:
    """The value ``name`` had in the environment when this module was imported."""
    return _AT_IMPORT.get(name)


_AT_IMPORT = dict(os.environ)


# ---------------------------------------------------------------- live ranks
# (aiospawn is imported in the function bodies: the module stays standard-library only.)


async def async_square(rank: int, fail: bool) -> int:
    """An ``async def fn``, on whichever loop the group names: rank 1 raises if ``fail``."""
    import sniffio

    await _sleep(sniffio.current_async_library(), 0)
    if fail and rank == 1:
        raise ValueError(f"async shard {rank} failed")
    return rank * rank


async def _sleep(library: str, seconds: float) -> None:
    if library == "trio":
        import trio

        await trio.sleep(seconds)
    else:
        import asyncio

        await asyncio.sleep(seconds)


def echo(rank: int) -> str:
    """Ready with a payload, then answer each message with (rank, message) until closed."""
    import aiospawn

    aiospawn.ready({"rank": rank, "pid": os.getpid()})
    channel = aiospawn.channel()
    channel.send(("hello", rank))
    for message in channel:
        if isinstance(message, str) and message == "die":  # an array's == is elementwise
            os.kill(os.getpid(), signal.SIGKILL)
        channel.send((rank, message))
    return "closed"


async def async_echo(rank: int) -> str:
    """:func:`echo` in an ``async def fn``; on SIGTERM its cleanup sends a last message."""
    import aiospawn

    aiospawn.ready(rank * 10)
    channel = aiospawn.channel()
    try:
        async for message in channel:
            await channel.send((rank, message))
    finally:
        await channel.send("cleaned up")
    return "closed"


class Shard:
    """The handler of :func:`serve_shard`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def scale(self, x: int) -> tuple[int, int]:
        return self.rank, self.rank * x

    def add(self, a: int, b: int = 0) -> tuple[int, int]:
        return self.rank, a + b

    def fail_on(self, bad: int) -> None:
        if self.rank == bad:
            raise ValueError(f"shard {self.rank} cannot")

    def stall(self, bad: int, seconds: float) -> int:
        if self.rank == bad:
            time.sleep(seconds)
        return self.rank

    def die(self, bad: int) -> None:
        if self.rank == bad:
            os.kill(os.getpid(), signal.SIGKILL)


def serve_shard(rank: int) -> int:
    """Ready, then serve :class:`Shard` calls until the supervisor closes the channel."""
    import aiospawn

    aiospawn.ready()
    aiospawn.serve(Shard(rank))
    return aiospawn.restart_count()


def restarted_inbox(rank: int) -> list[Any]:
    """Attempt 0 fails on its first message; a later attempt returns what it received."""
    import aiospawn

    aiospawn.ready(aiospawn.restart_count())
    channel = aiospawn.channel()
    if aiospawn.restart_count() == 0:
        channel.receive()
        raise RuntimeError("first attempt fails on its first message")
    return list(channel)


def unread_or_closed(rank: int) -> None:
    """Rank 0 never reads its channel; rank 1 reports what it sees once it is closed.

    Rank 1 raises on every path, so that its message reaches the test.
    """
    import aiospawn

    aiospawn.ready()
    if rank == 0:
        time.sleep(600)
    channel = aiospawn.channel()
    try:
        channel.receive()
    except EOFError:
        pass
    else:
        raise ValueError("a message came")
    # On Ray the release reaches the rank just after the supervisor's CLOSE
    # frame: a send or two in between go nowhere, then send() fails.
    for _ in range(100):
        try:
            channel.send("after aclose")
        except BrokenPipeError:
            raise ValueError("EOFError, then BrokenPipeError") from None
        time.sleep(0.05)
    raise ValueError("EOFError, then the sends went through")


def fail_before_ready(rank: int, failing: int) -> None:
    """Rank ``failing`` raises before it is ready; the others are ready and wait to be stopped."""
    import aiospawn

    if rank == failing:
        raise ValueError(f"rank {rank} failed before it was ready")
    aiospawn.ready(rank)
    time.sleep(600)


def ready_again_when_told(rank: int, port: int) -> int:
    """Attempt 0 is ready and fails on its first message; attempt 1 is ready only when told.

    Attempt 1 connects to the test on ``port``, reports, and says ready once the
    test sends a byte: so a supervisor that counted the dead attempt's
    readiness would return while attempt 1 is held.
    """
    import aiospawn

    attempt = aiospawn.restart_count()
    if attempt == 0:
        aiospawn.ready(attempt)
        aiospawn.channel().receive()
        raise RuntimeError("attempt 0 fails on its first message")
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(b"%d\n" % rank)
        connection.recv(1)
    aiospawn.ready(attempt)
    return attempt


def sized(seq: int) -> bytes:
    """Message ``seq``'s payload: up to 600 kB, so some span several board chunks."""
    return bytes([seq % 256]) * (seq % 5 * 150_000)


def send_sized(rank: int, count: int) -> None:
    import aiospawn

    channel = aiospawn.channel()
    for seq in range(count):
        channel.send((seq, sized(seq)))


class AsyncShard:
    """The ``async def`` handler of :func:`serve_shard_async`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    async def add(self, a: int, b: int = 0) -> tuple[int, int]:
        import sniffio

        await _sleep(sniffio.current_async_library(), 0)
        return self.rank, a + b

    async def fail_on(self, bad: int) -> None:
        import sniffio

        await _sleep(sniffio.current_async_library(), 0)
        if self.rank == bad:
            raise ValueError(f"async shard {self.rank} cannot")

    def whoami(self) -> int:
        return self.rank


async def serve_shard_async(rank: int) -> str:
    """Ready, then ``await aiospawn.serve()`` :class:`AsyncShard` calls until closed."""
    import aiospawn

    aiospawn.ready()
    await aiospawn.serve(AsyncShard(rank))
    return "served"


class PlainEcho:
    """A plain Ray actor (decorated by the caller): the floor of a Ray rank's channel."""

    def echo(self, message: Any) -> Any:
        return message
