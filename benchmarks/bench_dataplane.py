"""Scenario ``dataplane``: aiospawn's channels and calls against the floors and peers (issue 26).

Every peer's workers are started once, 8 of them (``NPROCS``), and serve the
same requests with the same handler (``dataplane_ranks.handle``); each trial
runs every peer once, in an order that rotates from trial to trial, all in
one event loop. The peers, each used the way its documentation shows:

* the floors: a socket pair per rank carrying raw length-prefixed frames (no
  pickle: the receiver reads the bytes straight into the array it returns),
  driven by a blocking loop in a worker thread, and by asyncio streams
  (``asyncio.open_connection(sock=...)``) on the event loop (bytes only);
* ``multiprocessing.Pipe`` and ``torch.multiprocessing``'s ``Queue`` (a pair
  per rank), from a worker thread;
* pyzmq: a ROUTER on ``zmq.asyncio`` over ``ipc://``, a DEALER per rank;
  pickle protocol 5 with out-of-band buffers as frames, sent without a copy;
* Ray actors, one per rank, on a local Ray instance (``ray.init``): awaited on
  the loop, and with ``ray.get`` in a worker thread; an argument for several
  ranks is ``ray.put`` once;
* vLLM's shared-memory ``MessageQueue``, as its ``MultiprocExecutor`` uses it:
  one broadcast queue to every worker, one reply queue per worker, driven from
  a worker thread (a 1-worker group for the 1-rank cases);
* Monarch: one actor per process of a ``this_host().spawn_procs`` mesh,
  awaited (``call_one`` on a slice for one rank, ``call`` for all);
* aiospawn: ``ctx.channel(rank)`` (send to each rank, then receive from each)
  and ``ctx.call("handle", ...)``, sync ranks, public API only.

Workers start from ``multiprocessing``'s fork server with numpy and torch
preloaded (aiospawn's ``forkserver`` ranks too, as it uses that server), so
that each can unpickle a tensor without importing torch on the clock. A peer
whose package is missing, that needs the asyncio backend, or whose start fails
is left out, and the report says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import dataplane_ranks as ranks_module
from dataplane_ranks import (
    HEADER_SIZE,
    RayRank,
    call_rank,
    channel_rank,
    decode_header,
    decode_small,
    encode,
    pipe_rank,
    queue_rank,
    read_frame,
    socket_rank,
    vllm_rank,
    write_frame,
    zmq_copy,
    zmq_frames,
    zmq_object,
    zmq_rank,
)
from harness import Measure, Peer, ScenarioResult, alternate, ms, percentile, progress

import aiospawn

#: Workers per peer; the 1-rank cases use rank 0.
NPROCS = 8

#: How every peer's workers start (see the module docstring).
START_METHOD = "forkserver"

#: Payload sizes in bytes.
SMALL, MEDIUM, LARGE = 64, 1_000_000, 100_000_000

#: The event-loop ticker's period: its worst lateness is the loop's worst gap.
TICK = 0.001

#: vLLM's readers busy-spin this long after their last read (``SpinCondition``);
#: its trials wait it out, untimed, so that the next peer does not pay for it.
VLLM_SPIN = 1.1

#: vLLM's broadcast chunk, as ``MultiprocExecutor`` sizes it (``VLLM_MQ_MAX_CHUNK_BYTES_MB``).
VLLM_CHUNK = 16 * 1024 * 1024

#: Ray stores arguments above this size in its object store (``max_direct_call_object_size``).
RAY_INLINE = 100 * 1024

#: This directory: the workers of Ray and Monarch import the rank modules from it.
HERE = os.path.dirname(os.path.abspath(__file__))

FLOOR_THREAD = "socket pair, thread"
FLOOR_ASYNCIO = "socket pair, asyncio streams"


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One row of the scenario: what is sent, to how many ranks, how often, against which floor."""

    name: str
    op: str  # "echo" (a round trip) or "take" (to the ranks, a small answer back)
    kind: str  # "bytes", "numpy" or "torch"
    size: int
    nranks: int
    count: int  # requests per trial
    micro: bool  # figures in µs (p50, p99 of a trial) rather than ms (one request)
    floor: str


def cases(quick: bool) -> list[Case]:
    """The cases, in report order."""
    small, fanout, medium = (200, 100, 30) if quick else (1000, 300, 100)
    bulk = [
        Case(
            name=f"100 MB {kind} to {nranks} rank{'s' if nranks > 1 else ''}",
            op="take",
            kind=kind,
            size=LARGE,
            nranks=nranks,
            count=1,
            micro=False,
            floor=FLOOR_THREAD,
        )
        for kind in ("numpy", "torch")
        for nranks in (1, NPROCS)
    ]
    return [
        Case(
            name="64 B round trip, 1 rank",
            op="echo",
            kind="bytes",
            size=SMALL,
            nranks=1,
            count=small,
            micro=True,
            floor=FLOOR_ASYNCIO,
        ),
        Case(
            name=f"64 B round trip, {NPROCS} ranks",
            op="echo",
            kind="bytes",
            size=SMALL,
            nranks=NPROCS,
            count=fanout,
            micro=True,
            floor=FLOOR_ASYNCIO,
        ),
        Case(
            name="1 MB round trip, 1 rank",
            op="echo",
            kind="bytes",
            size=MEDIUM,
            nranks=1,
            count=medium,
            micro=False,
            floor=FLOOR_ASYNCIO,
        ),
        Case(
            name="100 MB bytes round trip, 1 rank",
            op="echo",
            kind="bytes",
            size=LARGE,
            nranks=1,
            count=1,
            micro=False,
            floor=FLOOR_THREAD,
        ),
        *bulk,
    ]


def make_payload(kind: str, size: int) -> Any:
    """A payload whose pages are all touched (``zeros`` would map the zero page lazily)."""
    if kind == "bytes":
        return b"\x01" * size
    if kind == "numpy":
        import numpy

        return numpy.ones(size // 8, dtype=numpy.float64)
    import torch

    return torch.ones(size // 8, dtype=torch.float64)


# --- the peers -------------------------------------------------------------------------------


class Transport:
    """One peer: how its workers start and stop, and how a request reaches ranks and returns.

    A blocking transport's ``request`` runs in a worker thread; an async one's
    is awaited on the event loop.
    """

    name = ""
    needs: tuple[str, ...] = ()
    kinds: frozenset[str] = frozenset({"bytes", "numpy", "torch"})
    blocking = True
    asyncio_only = False
    #: Untimed seconds to wait after each trial (see ``VLLM_SPIN``).
    settle = 0.0

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        raise NotImplementedError

    def request(self, op: str, payload: Any, ranks: list[int]) -> Any:
        """Send ``(op, payload)`` to every rank of ``ranks``; the answers, in rank order."""
        raise NotImplementedError


def _context() -> Any:
    return multiprocessing.get_context(START_METHOD)


async def _join(processes: list[Any]) -> None:
    def join() -> None:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()

    await anyio.to_thread.run_sync(join)


class SocketThread(Transport):
    name = FLOOR_THREAD

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.sockets: list[socket.socket] = []
        self.streams: list[Any] = []
        processes = []
        stack.push_async_callback(self._close, processes)
        for _ in range(NPROCS):
            ours, theirs = socket.socketpair()
            process = _context().Process(target=socket_rank, args=(theirs,))
            await anyio.to_thread.run_sync(process.start)
            processes.append(process)
            theirs.close()
            self.sockets.append(ours)
            self.streams.append(ours.makefile("rb", buffering=64 * 1024))

    async def _close(self, processes: list[Any]) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                write_frame(sock, "quit", None)
        await _join(processes)
        for stream, sock in zip(self.streams, self.sockets, strict=True):
            stream.close()
            sock.close()

    def request(self, op: str, payload: Any, ranks: list[int]) -> Any:
        for rank in ranks:
            write_frame(self.sockets[rank], op, payload)
        return [read_frame(self.streams[rank])[1] for rank in ranks]


class SocketAsyncio(Transport):
    name = FLOOR_ASYNCIO
    kinds = frozenset({"bytes"})
    blocking = False
    asyncio_only = True

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        processes = []
        stack.push_async_callback(self._close, processes)
        for _ in range(NPROCS):
            ours, theirs = socket.socketpair()
            process = _context().Process(target=socket_rank, args=(theirs,))
            await anyio.to_thread.run_sync(process.start)
            processes.append(process)
            theirs.close()
            self.streams.append(await asyncio.open_connection(sock=ours))

    async def _close(self, processes: list[Any]) -> None:
        for _, writer in self.streams:
            for buffer in encode("quit", None):
                writer.write(buffer)
            with contextlib.suppress(OSError):
                await writer.drain()
        await _join(processes)
        for _, writer in self.streams:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def request(self, op: str, payload: Any, ranks: list[int]) -> Any:  # type: ignore[override]
        for rank in ranks:
            writer = self.streams[rank][1]
            for buffer in encode(op, payload):
                writer.write(buffer)
        for rank in ranks:
            await self.streams[rank][1].drain()
        answers = []
        for rank in ranks:
            reader = self.streams[rank][0]
            _, kind, meta_size, data_size = decode_header(await reader.readexactly(HEADER_SIZE))
            meta = await reader.readexactly(meta_size) if meta_size else b""
            data = await reader.readexactly(data_size) if data_size else b""
            answers.append(decode_small(kind, meta, data))
        return answers


class PipeThread(Transport):
    name = "multiprocessing.Pipe, thread"

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.conns: list[Any] = []
        processes: list[Any] = []
        stack.push_async_callback(self._close, processes)
        for _ in range(NPROCS):
            ours, theirs = _context().Pipe()
            process = _context().Process(target=pipe_rank, args=(theirs,))
            await anyio.to_thread.run_sync(process.start)
            processes.append(process)
            theirs.close()
            self.conns.append(ours)

    async def _close(self, processes: list[Any]) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        await _join(processes)
        for conn in self.conns:
            conn.close()

    def request(self, op: str, payload: Any, ranks: list[int]) -> Any:
        for rank in ranks:
            self.conns[rank].send((op, payload))
        return [self.conns[rank].recv() for rank in ranks]


class TorchQueueThread(Transport):
    name = "torch.multiprocessing Queue, thread"
    needs = ("torch",)

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        import torch.multiprocessing

        context = torch.multiprocessing.get_context(START_METHOD)
        self.queues: list[tuple[Any, Any]] = []
        processes: list[Any] = []
        stack.push_async_callback(self._close, processes)
        for _ in range(NPROCS):
            requests, replies = context.Queue(), context.Queue()
            process = context.Process(target=queue_rank, args=(requests, replies))
            await anyio.to_thread.run_sync(process.start)
            processes.append(process)
            self.queues.append((requests, replies))

    async def _close(self, processes: list[Any]) -> None:
        for requests, _ in self.queues:
            requests.put(None)
        await _join(processes)
        for requests, replies in self.queues:
            requests.close()
            replies.close()

    def request(self, op: str, payload: Any, ranks: list[int]) -> Any:
        for rank in ranks:
            self.queues[rank][0].put((op, payload))
        return [self.queues[rank][1].get() for rank in ranks]


class ZmqAsyncio(Transport):
    name = "pyzmq ROUTER/DEALER ipc, zmq.asyncio"
    needs = ("zmq",)
    blocking = False
    asyncio_only = True

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        import zmq
        import zmq.asyncio

        address = f"ipc://{scratch}/zmq-router"
        self.context = zmq.asyncio.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind(address)
        processes: list[Any] = []
        stack.push_async_callback(self._close, processes)
        for rank in range(NPROCS):
            process = _context().Process(target=zmq_rank, args=(rank, address))
            await anyio.to_thread.run_sync(process.start)
            processes.append(process)
        # A ROUTER drops what it sends to a peer it has not heard from yet.
        for _ in range(NPROCS):
            await self.router.recv_multipart()

    async def _close(self, processes: list[Any]) -> None:
        for rank in range(NPROCS):
            await self.router.send_multipart([str(rank).encode(), *zmq_frames(None)])
        await _join(processes)
        self.router.close(linger=0)
        self.context.term()

    async def request(self, op: str, payload: Any, ranks: list[int]) -> Any:  # type: ignore[override]
        frames = zmq_frames((op, payload))
        copy = zmq_copy(frames)
        for rank in ranks:
            await self.router.send_multipart([str(rank).encode(), *frames], copy=copy)
        answers: dict[int, Any] = {}
        while len(answers) < len(ranks):
            identity, *reply = await self.router.recv_multipart(copy=False)
            answers[int(identity.bytes)] = zmq_object(reply)
        return [answers[rank] for rank in ranks]


class _RayActors:
    """One local Ray instance and its actors, shared by the two Ray peers."""

    def __init__(self) -> None:
        self.actors: list[Any] = []

    async def open(self, stack: contextlib.AsyncExitStack) -> list[Any]:
        if self.actors:
            return self.actors
        import logging

        import ray

        def start() -> list[Any]:
            ray.init(
                num_cpus=NPROCS,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
            actors = [ray.remote(RayRank).remote() for _ in range(NPROCS)]
            ray.get([actor.handle.remote("echo", b"") for actor in actors])
            return actors

        stack.callback(ray.shutdown)
        self.actors = await anyio.to_thread.run_sync(start)
        return self.actors


_ray_actors = _RayActors()


def _ray_argument(payload: Any, ranks: list[int]) -> Any:
    """A large argument for several actors goes to the object store once, as Ray advises."""
    import ray

    if len(ranks) > 1 and ranks_module.nbytes(payload) > RAY_INLINE:
        return ray.put(payload)
    return payload


class RayAwait(Transport):
    name = "Ray actors, await"
    needs = ("ray",)
    blocking = False
    asyncio_only = True

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.actors = await _ray_actors.open(stack)

    async def request(self, op: str, payload: Any, ranks: list[int]) -> Any:  # type: ignore[override]
        argument = _ray_argument(payload, ranks)
        return await asyncio.gather(*(self.actors[r].handle.remote(op, argument) for r in ranks))


class RayThread(Transport):
    name = "Ray actors, ray.get in a thread"
    needs = ("ray",)

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.actors = await _ray_actors.open(stack)

    def request(self, op: str, payload: Any, ranks: list[int]) -> Any:
        import ray

        argument = _ray_argument(payload, ranks)
        return ray.get([self.actors[r].handle.remote(op, argument) for r in ranks])


class VllmThread(Transport):
    name = "vLLM MessageQueue, thread"
    needs = ("vllm", "regex", "torch", "zmq")
    settle = VLLM_SPIN

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.groups: dict[int, tuple[Any, list[Any]]] = {}
        for size in (1, NPROCS):
            processes: list[Any] = []
            stack.push_async_callback(self._close, size, processes)
            await anyio.to_thread.run_sync(self._start, size, processes)

    def _start(self, size: int, processes: list[Any]) -> None:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        broadcast = MessageQueue(size, size, max_chunk_bytes=VLLM_CHUNK)
        conns = []
        for rank in range(size):
            ours, theirs = _context().Pipe(duplex=False)
            process = _context().Process(
                target=vllm_rank, args=(rank, broadcast.export_handle(), theirs)
            )
            process.start()
            processes.append(process)
            theirs.close()
            conns.append(ours)
        replies = [MessageQueue.create_from_handle(conn.recv(), 0) for conn in conns]
        broadcast.wait_until_ready()
        for queue in replies:
            queue.wait_until_ready()
        self.groups[size] = (broadcast, replies)

    async def _close(self, size: int, processes: list[Any]) -> None:
        group = self.groups.pop(size, None)
        if group is not None:
            group[0].enqueue(("quit", None, None))
        await _join(processes)

    def request(self, op: str, payload: Any, ranks: list[int]) -> Any:
        broadcast, replies = self.groups[len(ranks)]
        broadcast.enqueue((op, payload, None))
        return [replies[rank].dequeue() for rank in ranks]


class MonarchAwait(Transport):
    name = "Monarch actors, await"
    needs = ("monarch",)
    blocking = False
    asyncio_only = True

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        from dataplane_monarch import MonarchRank
        from monarch.actor import this_host

        procs = this_host().spawn_procs(per_host={"procs": NPROCS})
        stack.push_async_callback(lambda: procs.stop())
        self.mesh = procs.spawn("dataplane", MonarchRank)
        await self.mesh.handle.call("echo", b"")
        self.first = self.mesh.slice(procs=0)

    async def request(self, op: str, payload: Any, ranks: list[int]) -> Any:  # type: ignore[override]
        if ranks == [0]:
            return [await self.first.handle.call_one(op, payload)]
        return list((await self.mesh.handle.call(op, payload)).values())


class AiospawnChannel(Transport):
    name = "aiospawn channel"
    blocking = False

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.group = await stack.enter_async_context(
            aiospawn.open_group(
                channel_rank, nprocs=NPROCS, start_method=START_METHOD, wait_ready=True
            )
        )

    async def request(self, op: str, payload: Any, ranks: list[int]) -> Any:  # type: ignore[override]
        for rank in ranks:
            await self.group.channel(rank).send((op, payload))
        return [await self.group.channel(rank).receive() for rank in ranks]


class AiospawnCall(Transport):
    name = "aiospawn ctx.call"
    blocking = False

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        self.group = await stack.enter_async_context(
            aiospawn.open_group(
                call_rank, nprocs=NPROCS, start_method=START_METHOD, wait_ready=True
            )
        )

    async def request(self, op: str, payload: Any, ranks: list[int]) -> Any:  # type: ignore[override]
        everyone = ranks == list(range(NPROCS))
        return await self.group.call("handle", op, payload, ranks=None if everyone else ranks)


#: In report order: the floors first.
TRANSPORTS: tuple[type[Transport], ...] = (
    SocketThread,
    SocketAsyncio,
    PipeThread,
    TorchQueueThread,
    VllmThread,
    ZmqAsyncio,
    AiospawnChannel,
    AiospawnCall,
    MonarchAwait,
    RayThread,
    RayAwait,
)


# --- measuring -------------------------------------------------------------------------------


def _timed_blocking(
    transport: Transport, op: str, payload: Any, ranks: list[int], count: int
) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        transport.request(op, payload, ranks)
        times.append(time.perf_counter() - started)
    return times


async def _timed_async(
    transport: Transport, op: str, payload: Any, ranks: list[int], count: int
) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await transport.request(op, payload, ranks)  # type: ignore[misc]
        times.append(time.perf_counter() - started)
    return times


async def with_ticker(body: Callable[[], Awaitable[list[float]]]) -> tuple[list[float], float]:
    """Run ``body`` while a task sleeping ``TICK`` in a loop records how late it wakes up.

    Returns what ``body`` returned and the worst lateness (the loop's worst gap), in seconds.
    """
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while True:
            before = time.perf_counter()
            await anyio.sleep(TICK)
            worst = max(worst, time.perf_counter() - before - TICK)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await anyio.sleep(0.02)  # past the ticker's first wake-ups
        worst = 0.0
        value = await body()
        tg.cancel_scope.cancel()
    return value, worst


def _runner(transport: Transport, case: Case, payload: Any) -> Callable[[], Awaitable[Measure]]:
    ranks = list(range(case.nranks))

    async def body() -> list[float]:
        if transport.blocking:
            return await anyio.to_thread.run_sync(
                _timed_blocking, transport, case.op, payload, ranks, case.count
            )
        return await _timed_async(transport, case.op, payload, ranks, case.count)

    async def run() -> Measure:
        if case.micro:
            micros = [value * 1e6 for value in await body()]
            measure = {"p50 [µs]": percentile(micros, 50), "p99 [µs]": percentile(micros, 99)}
        elif case.count > 1:
            measure = {"p50 [ms]": ms(percentile(await body(), 50))}
        else:
            times, gap = await with_ticker(body)
            measure = {"time [ms]": ms(times[0]), "worst loop gap [ms]": ms(gap)}
        if transport.settle:
            await anyio.sleep(transport.settle)
        return measure

    return run


def _mapping(description: dict[str, Any]) -> str:
    """A receiver's memory, in words, from :func:`dataplane_ranks.describe`."""
    perms, path = description["perms"], description["path"]
    if len(perms) == 4 and perms[3] == "s":
        what = f"a shared mapping of {path or 'anonymous shared memory'}"
    elif path in ("", "[heap]", "[anon]") or path.startswith("[anon"):
        what = "a private copy"
    else:
        what = f"a private mapping of {path}"
    writable = "writable" if "w" in perms[:3] else "read-only"
    if description.get("writeable") is False and writable == "writable":
        writable = "read-only array"
    return f"{what}, {writable}"


async def _probe(transport: Transport, kind: str) -> str:
    """What rank 0 gets for a 100 MB ``kind``: its memory, and whether it sees later writes."""
    payload = make_payload(kind, LARGE)

    async def ask(op: str, value: Any) -> Any:
        if transport.blocking:
            return (await anyio.to_thread.run_sync(transport.request, op, value, [0]))[0]
        return (await transport.request(op, value, [0]))[0]  # type: ignore[misc]

    description = await ask("keep", payload)
    payload.reshape(-1)[0] = 7.0
    seen = await ask("peek", None)
    if transport.settle:
        await anyio.sleep(transport.settle)
    later = "sees" if seen == 7.0 else "does not see"
    return f"{_mapping(description)}; {later} the sender's later writes"


def _missing(transport: Transport, backend: str) -> str | None:
    """Why ``transport`` cannot run here, or None."""
    absent = [name for name in transport.needs if importlib.util.find_spec(name) is None]
    if absent:
        return f"not installed: {', '.join(absent)}"
    if transport.asyncio_only and backend != "asyncio":
        return f"needs the asyncio backend (this run: {backend})"
    return None


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def _prepare_workers(here: str) -> None:
    """Preload numpy and torch in the fork server, and let Ray's and Monarch's workers find us."""
    preload = [name for name in ("numpy", "torch") if importlib.util.find_spec(name) is not None]
    multiprocessing.forkserver.set_forkserver_preload([*preload, "dataplane_ranks"])
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here if not path else f"{here}{os.pathsep}{path}"


async def dataplane(result: ScenarioResult, quick: bool) -> None:
    """Every peer, every case, interleaved; then what each receiver got for 100 MB arrays."""
    backend = _backend_name()
    trials_small, trials_bulk = (2, 2) if quick else (5, 7)
    _prepare_workers(HERE)
    result.note(f"Load average before the workers started: {_load()}.")
    with tempfile.TemporaryDirectory(prefix="aiospawn-bench-") as scratch:
        async with contextlib.AsyncExitStack() as stack:
            running: list[Transport] = []
            for kind in TRANSPORTS:
                transport = kind()
                reason = _missing(transport, backend)
                if reason is None:
                    started = time.monotonic()
                    try:
                        await transport.open(stack, scratch)
                    except Exception as exc:  # a peer that cannot run here: say why, go on
                        reason = f"did not start: {type(exc).__name__}: {exc}"
                    else:
                        progress(
                            f"[{result.name}] {transport.name}: started in"
                            f" {time.monotonic() - started:.1f} s"
                        )
                        running.append(transport)
                        continue
                progress(f"[{result.name}] {transport.name}: skipped, {reason}")
                result.note(f"Skipped: {transport.name}: {reason}.")
            for case in cases(quick):
                peers = []
                for transport in running:
                    if case.kind not in transport.kinds or (
                        case.kind != "bytes" and _missing_kind(case.kind)
                    ):
                        continue
                    payload = make_payload(case.kind, case.size)
                    trials = trials_small if case.micro or case.count > 1 else trials_bulk
                    peers.append(Peer(transport.name, _runner(transport, case, payload), trials, 1))
                if not peers:
                    result.note(f"{case.name}: no peer can run it here.")
                    continue
                result.floors[case.name] = case.floor
                result.note(f"{case.name}: load average at the start {_load()}.")
                await alternate(result, case.name, peers, rotate=True)
                del peers
            result.note(f"Load average after the timed cases: {_load()}.")
            for kind in ("numpy", "torch"):
                if _missing_kind(kind):
                    continue
                for transport in running:
                    if kind in transport.kinds:
                        what = await _probe(transport, kind)
                        progress(f"[{result.name}] {transport.name}, {kind}: {what}")
                        result.note(f"Receiver of a 100 MB {kind} ({transport.name}): {what}.")
    result.note(
        f"{NPROCS} workers per peer, started once from `multiprocessing`'s fork server with"
        " numpy and torch preloaded (Ray's and Monarch's start their own); the 1-rank cases use"
        " rank 0. Each trial runs every peer once, the order rotating by one peer per trial,"
        " after one untimed warm-up each. Round trip: the payload to each rank, and back;"
        " 'to N ranks': the payload to each, a small answer back once the rank holds it"
        " (unpickled, not read). µs figures are the p50 and p99 of one trial's requests (the"
        " table's median and p95 are across trials); '100 MB' figures time one request per"
        " trial, while a task sleeping 1 ms in a loop records the loop's worst gap."
        " 'ratio to floor' divides by the floor's median in the same case: the asyncio"
        " socket pair for small messages and 1 MB, the thread's for 100 MB."
        f" 1 MB = {MEDIUM:,} bytes, 100 MB = {LARGE:,} bytes; arrays are float64, all ones."
    )
    result.note(
        "How each peer is driven: see `benchmarks/bench_dataplane.py`'s docstring. Where torch is"
        " imported, `multiprocessing.Pipe` pickles tensors with torch's reductions (shared"
        " memory), as `torch.multiprocessing` does. vLLM's workers busy-spin for 1 s after each"
        " read; each vLLM trial waits that out, untimed."
    )


def _missing_kind(kind: str) -> bool:
    return importlib.util.find_spec(kind) is None


def _backend_name() -> str:
    """The event loop this scenario runs on: asyncio, or (``--backend trio``) trio."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    return "asyncio"
