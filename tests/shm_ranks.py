"""Ranks for test_shared_memory: large buffers that travel through a memfd, both ways.

Each is called as ``fn(rank, *args)``; importable, so that spawn and
forkserver ranks reach them. A rank says how many mappings of aiospawn's
memfds it holds (:func:`memfd_maps`), which is how a test sees that what it
sent was mapped and not copied.
"""

from __future__ import annotations

import array
import contextlib
import os
import pickle
import socket
import sys
import time
from typing import Any

import aiospawn


def memfd_maps(*, pool: bool = False) -> list[str]:
    """This process's private mappings of aiospawn's memfds (``/proc/self/maps`` lines).

    What a receiver holds: its mappings are private. With ``pool``, the
    supervisor's shared ones of its pool's segments too.
    """
    with open("/proc/self/maps") as maps:
        return [
            line
            for line in maps
            if "/memfd:aiospawn" in line and (pool or line.split()[1].endswith("p"))
        ]


def memfd_inodes() -> set[int]:
    """The inodes of the memfds this process maps: one per memfd."""
    return {int(line.split()[4]) for line in memfd_maps()}


def inode_of(value: Any) -> int:
    """The inode of the memfd an array's or a tensor's bytes lie in here; 0 if none."""
    address = value.data_ptr() if hasattr(value, "data_ptr") else value.ctypes.data
    for line in memfd_maps():
        span, _, _, _, inode = line.split()[:5]
        start, end = (int(part, 16) for part in span.split("-"))
        if start <= address < end:
            return int(inode)
    return 0


class Handler:
    """Calls that take and return large buffers."""

    def __init__(self) -> None:
        self.kept: Any = None

    def echo(self, value: Any) -> tuple[int, Any]:
        """``value`` back, and how many memfd mappings this rank held with it."""
        return len(memfd_maps()), value

    def inodes(self, value: Any) -> list[int]:
        """The memfds mapped here while ``value`` lives (one, if it came in one)."""
        del value  # held by the caller's frame until the answer is made
        return sorted(memfd_inodes())

    def keep(self, value: Any) -> Any:
        """Keep ``value``, write -1 into its first element, and return it."""
        self.kept = value
        value[0] = -1
        return value

    def peek(self) -> Any:
        """The first two elements of what was kept, copied."""
        return self.kept[:2].copy()


def echo(rank: int) -> None:
    """Send back ``(maps held, message)`` for every message; then serve :class:`Handler`."""
    channel = aiospawn.channel()
    for message in channel:
        if isinstance(message, str) and message == "serve":
            break
        channel.send((len(memfd_maps()), message))
    aiospawn.serve(Handler())


async def echo_async(rank: int) -> None:
    channel = aiospawn.channel()
    async for message in channel:
        if isinstance(message, str) and message == "serve":
            break
        await channel.send((len(memfd_maps()), message))
    await aiospawn.serve(Handler())


def return_views(rank: int) -> list[Any]:
    """Return the first message (a large buffer arrives as a memoryview) and views of its own."""
    received = aiospawn.channel().receive()
    grid = memoryview(array.array("i", range(6))).cast("B").cast("i", (2, 3))
    return [received, memoryview(b"own" * 10), grid]


def return_record_view(rank: int) -> memoryview:
    """Return a view of a format no receiver could rebuild: the rank fails, saying so."""
    import numpy as np

    return memoryview(np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]))


class Holder:
    """Keeps arrays (or tensors) by name, and says where they lie and what they hold."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}

    def hold(self, key: str, value: Any) -> int:
        """Keep ``value`` as ``key``; return the inode of the memfd it lies in (0: none)."""
        self.held[key] = value
        return inode_of(value)

    def check(self, key: str) -> tuple[float, float]:
        """The smallest and largest element of what is kept as ``key``."""
        value = self.held[key]
        if hasattr(value, "numpy"):
            # Through numpy: torch's own kernels can hang in a rank forked
            # from a supervisor whose torch started its thread pool.
            value = value.numpy()
        return float(value.min()), float(value.max())

    def drop(self, key: str) -> None:
        """Let go of ``key``: its mapping goes, and its release with it."""
        del self.held[key]

    def memfds(self) -> int:
        """How many descriptors of aiospawn's memfds this rank holds."""
        found = 0
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:aiospawn")
        return found

    def drop_in_thread(self, key: str) -> None:
        """:meth:`drop`, from another thread: the mapping's finalizer runs there."""
        import threading

        value = [self.held.pop(key)]
        thread = threading.Thread(target=value.clear)
        thread.start()
        thread.join()


def holder(rank: int) -> None:
    """Say ready; answer ``(method, *args)`` messages with :class:`Holder`; then serve it."""
    aiospawn.ready()
    keeper = Holder()
    channel = aiospawn.channel()
    for message in channel:
        if message == ("serve",):
            break
        method, *args = message
        del message  # nothing here holds what a drop lets go of
        answer = getattr(keeper, method)(*args)
        del args
        channel.send(answer)
    aiospawn.serve(keeper)


async def holder_async(rank: int) -> None:
    aiospawn.ready()
    keeper = Holder()
    channel = aiospawn.channel()
    async for message in channel:
        if message == ("serve",):
            break
        method, *args = message
        del message
        answer = getattr(keeper, method)(*args)
        del args
        await channel.send(answer)
    await aiospawn.serve(keeper)


def bad_frame(rank: int, how: str) -> None:
    """Say ready; rank 0 writes a shared MESSAGE frame that breaks the format (``how``); wait.

    ``"no fd"``: the frame comes without its descriptor. ``"pipe"``: with a
    pipe's, not a sealed memfd. ``"extra fd"``: a plain MESSAGE frame with a
    descriptor. ``"bad layout"``: a sealed memfd smaller than the layout says.
    ``"pooled"``: a pooled segment's layout and descriptor, which only the
    supervisor sends.
    """
    from aiospawn._rank import buffers
    from aiospawn._rank.wire import HEADER, Link

    aiospawn.ready()
    if rank != 0:
        while True:
            time.sleep(60)
    fd = aiospawn.channel()._frames.fd
    body = pickle.dumps("x")
    layout = buffers.LAYOUT.pack(1) + buffers.SPAN.pack(0, 1 << 20)
    passed: list[int] = []
    kind = Link.MESSAGE | buffers.SHARED
    if how == "pipe":
        passed = [os.pipe()[0]]
    elif how == "extra fd":
        kind = Link.MESSAGE
        layout = b""
        passed = [os.pipe()[0]]
    elif how == "bad layout":
        passed = [buffers.pack(b"", [memoryview(b"y" * 4096)]).fd]
    elif how == "pooled":
        layout = buffers.layout([(0, 4096)], token=1)
        passed = [buffers.new_segment(4096)[1]]
    frame = HEADER.pack(kind, len(layout) + len(body)) + layout + body
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    with contextlib.suppress(OSError):
        if passed:
            rights = array.array("i", passed)
            sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        else:
            sock.sendall(frame)
    sock.detach()
    while True:
        time.sleep(60)


def is_torch_loaded(rank: int) -> bool:
    return "torch" in sys.modules
