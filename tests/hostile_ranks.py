"""Rank functions that misuse their process: odd exit codes, closed descriptors, snooping.

Also ranks that misuse their channel: bytes written to its socket directly,
and data whose pickling or unpickling raises (``SystemExit`` included).

Importable, so that ``spawn`` and ``forkserver`` ranks can run them.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiospawn


def exit_with(rank: int, code: int) -> None:
    """``sys.exit(code)``."""
    sys.exit(code)


def exit_with_int(rank: int, code: str) -> None:
    """``sys.exit(int(code))``: for ``aiospawn run --fn``, whose arguments are strings."""
    sys.exit(int(code))


def exit_with_code_or_return(rank: int, code: int) -> str:
    """Rank 0 calls ``sys.exit(code)``; the others return."""
    if rank == 0:
        sys.exit(code)
    return "fine"


def put_then_return(rank: int, queue: Any, size: int) -> int:
    """Put ``size`` bytes on a ``multiprocessing.Queue`` (its feeder thread sends them), return."""
    queue.put(b"x" * size)
    return rank


def _fd_table() -> dict[int, tuple[str, int]]:
    """``fd -> (what it is, access mode)`` for every descriptor of this process."""
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            with open(f"/proc/self/fdinfo/{name}") as info:
                flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
        except (OSError, StopIteration):  # the listing's own descriptor
            continue
        table[int(name)] = (target, flags & os.O_ACCMODE)
    return table


def _mapped_heartbeats() -> int:
    with open("/proc/self/maps") as maps:
        return sum("aiospawn-heartbeat" in line for line in maps)


def report_holdings(rank: int, events: Any) -> None:
    """Send ``("holdings", rank, fd table, heartbeat mappings)``, then wait to be stopped."""
    events.send(("holdings", rank, _fd_table(), _mapped_heartbeats()))
    while True:
        time.sleep(60)


def close_every_fd_then_return(rank: int) -> str:
    """Close every descriptor above 2, as daemonising code does, then return a value."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    return "lost"


def close_every_fd_then_exit(rank: int, code: int) -> None:
    """Close every descriptor above 2, then ``sys.exit(code)``."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    sys.exit(code)


def close_every_fd_then_wait(rank: int, report: str) -> None:
    """Close every descriptor above 2, write ``report`` (a FIFO's path), then sleep on."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    with open(report, "w") as fifo:
        fifo.write(f"{os.getpid()}\n")
    while True:
        time.sleep(60)


def reuse_low_fds_then_return(rank: int, path: str) -> str:
    """Close every descriptor above 2, open files until one lands on each freed number, return.

    The channel's old number (if it was low) then holds a file of the rank's;
    the frame must not be written into it.
    """
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    opened = [os.open(path, os.O_WRONLY | os.O_APPEND) for _ in range(200)]
    del opened  # left open: the bootstrap must not write into any of them
    return "lost"


def generator_rank(rank: int) -> Iterator[int]:
    """A generator function: calling it runs nothing."""
    yield rank


async def async_generator_rank(rank: int) -> AsyncIterator[int]:
    """An async generator function: calling it runs nothing."""
    yield rank


def returns_rank(rank: int) -> int:
    return rank


# ------------------------------------------------------ what a channel carries


def write_to_channel(rank: int, writing: int, data: bytes, junk: int) -> None:
    """Say ready; rank ``writing`` then writes ``data`` and ``junk`` MiB to its channel's socket.

    As code that writes to the channel's descriptor itself would. Only its
    first attempt does; every rank then waits to be stopped (or, restarted,
    returns once the supervisor closes its end).
    """
    aiospawn.ready()
    channel = aiospawn.channel()
    if rank == writing and aiospawn.restart_count() == 0:
        fd = channel._frames.fd
        os.set_blocking(fd, True)
        # The supervisor stops reading at the first bad header and closes its
        # end as the rank is stopped: the writes then fail, or block until then.
        with contextlib.suppress(OSError):
            _write_all(fd, data)
            for _ in range(junk):
                _write_all(fd, b"\xa5" * (1 << 20))
        while True:
            time.sleep(60)
    for _ in channel:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Bomb:
    """Pickles fine; unpickling it (in whichever process loads it) raises ``what``.

    ``what``: ``"value"`` (ValueError), ``"exit"`` (``sys.exit(3)``, as a module
    that runs a script at import does) or ``"interrupt"`` (KeyboardInterrupt).
    ``pad`` bytes make its pickle that much larger.
    """

    def __init__(self, what: str, pad: int = 0) -> None:
        self.what = what
        self.pad = pad

    def __reduce__(self) -> tuple[Any, ...]:
        return detonate, (self.what, b"\0" * self.pad)


def detonate(what: str, pad: bytes) -> None:
    if what == "exit":
        sys.exit(3)
    if what == "interrupt":
        raise KeyboardInterrupt
    raise ValueError("this pickle does not load here")


class PickleBomb:
    """Pickling it raises ``what`` (as :class:`Bomb`'s); with ``"exit0"``, ``sys.exit(0)``."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        if self.what == "exit0":
            sys.exit(0)
        detonate(self.what, b"")
        raise AssertionError("unreachable")


def send_bomb_then_more(rank: int, what: str, pad: int) -> None:
    """Send a :class:`Bomb`, then ``"after"``, then return."""
    channel = aiospawn.channel()
    channel.send(Bomb(what, pad))
    channel.send("after")


def ready_with_bomb(rank: int, what: str) -> int:
    """Rank 1 says ready with a :class:`Bomb`, the others with their rank; serve until closed."""
    aiospawn.ready(Bomb(what) if rank == 1 else rank)
    for _ in aiospawn.channel():
        pass
    return rank


def _refusals(attempt: Callable[[], Any]) -> str:
    try:
        attempt()
    except TypeError as exc:
        return f"TypeError, caused by {type(exc.__cause__).__name__}"
    return "sent"


def receive_bombs(rank: int, what: str) -> None:
    """Try to send a :class:`PickleBomb`; then report each message received, or why not."""
    channel = aiospawn.channel()
    channel.send(("send", _refusals(lambda: channel.send(PickleBomb(what)))))
    while True:
        try:
            message = channel.receive()
        except pickle.UnpicklingError as exc:
            channel.send(("undecodable", type(exc.__cause__).__name__))
        except EOFError:
            return
        else:
            channel.send(("got", message))


async def receive_bombs_async(rank: int, what: str) -> None:
    channel = aiospawn.channel()
    try:
        await channel.send(PickleBomb(what))
        refusal = "sent"
    except TypeError as exc:
        refusal = f"TypeError, caused by {type(exc.__cause__).__name__}"
    await channel.send(("send", refusal))
    while True:
        try:
            message = await channel.receive()
        except pickle.UnpicklingError as exc:
            await channel.send(("undecodable", type(exc.__cause__).__name__))
        except EOFError:
            return
        else:
            await channel.send(("got", message))


class HostileHandler:
    """Collective-call methods whose answers or arguments misbehave while pickled."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls = 0

    def whoami(self) -> int:
        return self.rank

    def count(self) -> int:
        """How many times this rank's ``count`` ran."""
        self.calls += 1
        return self.calls

    def echo(self, value: Any) -> Any:
        return value

    def bomb(self, what: str, bombing: int) -> Any:
        """Rank ``bombing`` answers with a :class:`Bomb`: the supervisor cannot load it."""
        return Bomb(what) if self.rank == bombing else self.rank

    def pickle_bomb(self, what: str) -> Any:
        """Answer with a :class:`PickleBomb`: the rank cannot pickle it."""
        return PickleBomb(what)


class AsyncHostileHandler(HostileHandler):
    """The same, with ``async def`` methods where it matters."""

    async def pickle_bomb(self, what: str) -> Any:  # type: ignore[override]
        return PickleBomb(what)


def serve_hostile(rank: int) -> str:
    aiospawn.ready()
    aiospawn.serve(HostileHandler(rank))
    return "served"


async def serve_hostile_async(rank: int) -> str:
    aiospawn.ready()
    await aiospawn.serve(AsyncHostileHandler(rank))
    return "served"
