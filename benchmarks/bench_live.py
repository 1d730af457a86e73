"""Scenario ``live``: messages and collective calls to live ranks, against raw pipes and queues.

Every peer talks to long-lived fork ranks started once for the scenario, each
running the same :func:`answer` loop over its own transport:

* aiospawn: ``ctx.channel(rank)`` on the event loop; the rank's end is
  ``aiospawn.channel()`` (a sync rank, blocking calls). Collective calls:
  ``ctx.call("ping")`` on ranks running ``aiospawn.serve()``.
* raw Pipe, loop in a thread: a ``multiprocessing.Pipe`` driven by a blocking
  loop that runs in a worker thread (``anyio.to_thread.run_sync``), timed
  there: the floor, what the bytes cost with nothing async in the way.
* raw Pipe, to_thread per message: the same pipe, each round trip one
  ``await anyio.to_thread.run_sync(...)``, as an async service without
  aiospawn would drive it.
* mp.Queue, loop in a thread: a pair of ``multiprocessing.Queue`` (a feeder
  thread, a lock and a pipe each), driven like the raw pipe.

Messages are ``bytes`` objects, pickled by every transport alike.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.to_thread
from harness import Measure, Peer, ScenarioResult, alternate, ms, percentile

import aiospawn

SMALL = 64
LARGE = 1024 * 1024
CALL_RANKS = 8
TICK = 0.001

# --- the ranks -----------------------------------------------------------------------------


def answer(message: Any, send: Callable[[Any], None], receive: Callable[[], Any]) -> None:
    """Serve one request: echo bytes; ``("sink", n)``: take n messages, then ack;
    ``("emit", n, size)``: send n messages of ``size`` bytes."""
    if isinstance(message, bytes):
        send(message)
    elif message[0] == "sink":
        for _ in range(message[1]):
            receive()
        send(b"ok")
    elif message[0] == "emit":
        payload = bytes(message[2])
        for _ in range(message[1]):
            send(payload)


def channel_rank(rank: int) -> None:
    """An aiospawn rank answering on its channel until the supervisor closes it."""
    channel = aiospawn.channel()
    aiospawn.ready()
    while True:
        try:
            message = channel.receive()
        except EOFError:
            return
        answer(message, channel.send, channel.receive)


class Pinger:
    """The handler of the collective-call ranks."""

    def ping(self) -> None:
        return None


def serving_rank(rank: int) -> None:
    """An aiospawn rank serving ``ctx.call()``."""
    aiospawn.ready()
    aiospawn.serve(Pinger())


def pipe_rank(conn: Connection) -> None:
    """A plain process answering on a ``multiprocessing.Pipe`` until it gets None.

    Not until EOF: the processes forked after it hold copies of the parent's end.
    """
    while (message := conn.recv()) is not None:
        answer(message, conn.send, conn.recv)


def queue_rank(requests: Any, replies: Any) -> None:
    """A plain process answering on a pair of ``multiprocessing.Queue`` until it gets None."""
    while (message := requests.get()) is not None:
        answer(message, replies.put, requests.get)


# --- the peers' transports -----------------------------------------------------------------


class Blocking:
    """A plain process and its blocking ``send`` / ``receive``: a pipe or a pair of queues."""

    def __init__(self, kind: str) -> None:
        context = multiprocessing.get_context("fork")
        if kind == "pipe":
            ours, theirs = context.Pipe()
            self.send, self.receive = ours.send, ours.recv
            self.process = context.Process(target=pipe_rank, args=(theirs,))
        else:
            requests, replies = context.Queue(), context.Queue()
            self.send, self.receive = requests.put, replies.get
            self.process = context.Process(target=queue_rank, args=(requests, replies))
        self.process.start()

    def close(self) -> None:
        self.send(None)
        self.process.join()

    def round_trips(self, payload: bytes, count: int) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            self.send(payload)
            self.receive()
            times.append(time.perf_counter() - started)
        return times

    def stream(self, size: int, count: int) -> tuple[float, float]:
        """Seconds to send ``count`` messages of ``size`` bytes to the process, and from it."""
        payload = bytes(size)
        started = time.perf_counter()
        self.send(("sink", count))
        for _ in range(count):
            self.send(payload)
        self.receive()
        to_rank = time.perf_counter() - started
        started = time.perf_counter()
        self.send(("emit", count, size))
        for _ in range(count):
            self.receive()
        return to_rank, time.perf_counter() - started


class LoopSocket:
    """A plain process answering on a socket pair that the event loop drives directly.

    The process reads and writes with a ``multiprocessing.connection.Connection``
    (a 4-byte length, then the pickle); this end is non-blocking, written and
    read on the loop with ``anyio.wait_writable`` / ``wait_readable``: the
    floor of any event-loop transport.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("fork")
        child = Connection(theirs.detach())
        self.process = context.Process(target=pipe_rank, args=(child,))
        self.process.start()
        child.close()
        ours.setblocking(False)
        self.fd = ours.detach()

    async def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        view = memoryview(struct.pack("!i", len(data)) + data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                await anyio.wait_writable(self.fd)

    async def receive(self) -> Any:
        (size,) = struct.unpack("!i", await self._read(4))
        return pickle.loads(await self._read(size))

    async def _read(self, size: int) -> bytes:
        parts, left = [], size
        while left:
            try:
                data = os.read(self.fd, left)
            except BlockingIOError:
                await anyio.wait_readable(self.fd)
                continue
            parts.append(data)
            left -= len(data)
        return b"".join(parts)

    async def aclose(self) -> None:
        await self.send(None)
        os.close(self.fd)
        await anyio.to_thread.run_sync(self.process.join)


async def channel_round_trips(channel: Any, payload: bytes, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await channel.send(payload)
        await channel.receive()
        times.append(time.perf_counter() - started)
    return times


async def channel_stream(channel: Any, size: int, count: int) -> tuple[float, float]:
    """As :meth:`Blocking.stream`, over an aiospawn channel."""
    payload = bytes(size)
    started = time.perf_counter()
    await channel.send(("sink", count))
    for _ in range(count):
        await channel.send(payload)
    await channel.receive()
    to_rank = time.perf_counter() - started
    started = time.perf_counter()
    await channel.send(("emit", count, size))
    for _ in range(count):
        await channel.receive()
    return to_rank, time.perf_counter() - started


def latency(times: list[float]) -> Measure:
    micros = [value * 1e6 for value in times]
    return {"p50 [µs]": percentile(micros, 50), "p99 [µs]": percentile(micros, 99)}


def rates(size: int, count: int, seconds: tuple[float, float]) -> Measure:
    megabytes = size * count / 1e6
    to_rank, from_rank = seconds
    return {"to rank [MB/s]": megabytes / to_rank, "from rank [MB/s]": megabytes / from_rank}


async def to_thread_round_trips(pipe: Blocking, payload: bytes, count: int) -> list[float]:
    def one() -> None:
        pipe.send(payload)
        pipe.receive()

    times = []
    for _ in range(count):
        started = time.perf_counter()
        await anyio.to_thread.run_sync(one)
        times.append(time.perf_counter() - started)
    return times


def fan_out(pipes: list[Blocking], count: int) -> list[float]:
    """The raw floor of a collective call: a request down every pipe, then every reply."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        for pipe in pipes:
            pipe.send(b"ping")
        for pipe in pipes:
            pipe.receive()
        times.append(time.perf_counter() - started)
    return times


async def collective_calls(group: Any, count: int, ranks: list[int] | None) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await group.call("ping", ranks=ranks)
        times.append(time.perf_counter() - started)
    return times


async def with_ticker(body: Callable[[], Any]) -> Measure:
    """Run ``body`` while a task sleeping 1 ms in a loop records how late each wake-up is."""
    lags: list[float] = []

    async def tick() -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(TICK)
            lags.append(time.monotonic() - before - TICK)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await anyio.sleep(0.02)  # let the ticker settle
        lags.clear()
        started = time.monotonic()
        await body()
        elapsed = time.monotonic() - started
        tg.cancel_scope.cancel()
    return {
        "max lag [ms]": ms(max(lags)),
        "p99 lag [ms]": ms(percentile(lags, 99)),
        "window [s]": elapsed,
    }


# --- the scenario --------------------------------------------------------------------------


def load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


async def live(result: ScenarioResult, quick: bool) -> None:
    """Round trips, throughput, collective calls and event-loop lag while 1 GB streams."""
    trials = 3 if quick else 7
    small_count, large_count = (500, 50) if quick else (2000, 200)
    stream_count = 64 if quick else 256  # 1 MB messages each way per trial
    calls = 300 if quick else 1000
    gigabyte = 1024  # 1 MB messages: 512 to rank 0 while rank 1 sends 512
    pipe, queue = Blocking("pipe"), Blocking("queue")
    lag_pipes = [Blocking("pipe"), Blocking("pipe")]
    loop_socket = LoopSocket()
    try:
        async with aiospawn.open_group(
            channel_rank, nprocs=2, start_method="fork", wait_ready=True
        ) as group:
            channel = group.channel(0)

            for size, count, label in ((SMALL, small_count, "64 B"), (LARGE, large_count, "1 MB")):
                payload = bytes(size)
                result.note(f"{label} round trips: load average at the start {load()}.")

                async def ours(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(await channel_round_trips(channel, payload, count))

                async def on_loop(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(await channel_round_trips(loop_socket, payload, count))

                async def pipe_loop(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(await anyio.to_thread.run_sync(pipe.round_trips, payload, count))

                async def pipe_per(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(await to_thread_round_trips(pipe, payload, count))

                async def queue_loop(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(
                        await anyio.to_thread.run_sync(queue.round_trips, payload, count)
                    )

                await alternate(
                    result,
                    f"round trip, {label}, {count} per trial",
                    [
                        Peer("aiospawn", ours, trials, warmup=1),
                        Peer("raw Pipe, loop in a thread", pipe_loop, trials, warmup=1),
                        Peer("raw socket on the loop", on_loop, trials, warmup=1),
                        Peer("raw Pipe, to_thread per message", pipe_per, trials, warmup=1),
                        Peer("mp.Queue, loop in a thread", queue_loop, trials, warmup=1),
                    ],
                )

            result.note(f"1 MB throughput: load average at the start {load()}.")

            async def ours_stream() -> Measure:
                return rates(
                    LARGE, stream_count, await channel_stream(channel, LARGE, stream_count)
                )

            async def pipe_stream() -> Measure:
                seconds = await anyio.to_thread.run_sync(pipe.stream, LARGE, stream_count)
                return rates(LARGE, stream_count, seconds)

            async def queue_stream() -> Measure:
                seconds = await anyio.to_thread.run_sync(queue.stream, LARGE, stream_count)
                return rates(LARGE, stream_count, seconds)

            await alternate(
                result,
                f"throughput, 1 MB messages, {stream_count} MB each way",
                [
                    Peer("aiospawn", ours_stream, trials, warmup=1),
                    Peer("raw Pipe, loop in a thread", pipe_stream, trials, warmup=1),
                    Peer("mp.Queue, loop in a thread", queue_stream, trials, warmup=1),
                ],
            )

            result.note(f"Event-loop lag: load average at the start {load()}.")
            half = gigabyte // 2

            async def ours_gigabyte() -> None:
                async def sink() -> None:
                    to_rank = group.channel(0)
                    await to_rank.send(("sink", half))
                    for _ in range(half):
                        await to_rank.send(bytes(LARGE))
                    await to_rank.receive()

                async def emit() -> None:
                    from_rank = group.channel(1)
                    await from_rank.send(("emit", half, LARGE))
                    for _ in range(half):
                        await from_rank.receive()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(sink)
                    tg.start_soon(emit)

            async def pipes_gigabyte() -> None:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, _sink_blocking, lag_pipes[0], half)
                    tg.start_soon(anyio.to_thread.run_sync, _emit_blocking, lag_pipes[1], half)

            async def ours_lag() -> Measure:
                return await with_ticker(ours_gigabyte)

            async def pipes_lag() -> Measure:
                return await with_ticker(pipes_gigabyte)

            async def idle_lag() -> Measure:
                return await with_ticker(lambda: anyio.sleep(1.0))

            await alternate(
                result,
                "1 GB streaming (512 MB to rank 0, 512 MB from rank 1)",
                [
                    Peer("aiospawn", ours_lag, max(2, trials // 2)),
                    Peer("raw Pipes, in threads", pipes_lag, max(2, trials // 2)),
                    Peer("idle loop", idle_lag, 2),
                ],
            )

        result.note(f"Collective calls: load average at the start {load()}.")
        call_pipes = [Blocking("pipe") for _ in range(CALL_RANKS)]
        try:
            async with aiospawn.open_group(
                serving_rank, nprocs=CALL_RANKS, start_method="fork", wait_ready=True
            ) as callers:

                async def call_all() -> Measure:
                    return latency(await collective_calls(callers, calls, None))

                async def call_one() -> Measure:
                    return latency(await collective_calls(callers, calls, [0]))

                async def pipes_all() -> Measure:
                    return latency(await anyio.to_thread.run_sync(fan_out, call_pipes, calls))

                async def pipe_one() -> Measure:
                    return latency(await anyio.to_thread.run_sync(fan_out, call_pipes[:1], calls))

                await alternate(
                    result,
                    f"collective call, {calls} per trial",
                    [
                        Peer("aiospawn", call_all, trials, warmup=1),
                        Peer("aiospawn, 1 rank", call_one, trials, warmup=1),
                        Peer("raw Pipes to 8, loop in a thread", pipes_all, trials, warmup=1),
                        Peer("raw Pipe to 1, loop in a thread", pipe_one, trials, warmup=1),
                    ],
                )
        finally:
            for each in call_pipes:
                each.close()
    finally:
        for each in (pipe, queue, *lag_pipes):
            each.close()
        await loop_socket.aclose()
    result.note(
        "Long-lived fork ranks, started once for the scenario; every peer's process runs the"
        " same request loop (`answer()` in `bench_live.py`) over its own transport, and every"
        " message is a `bytes` object, pickled by each transport alike. Round trip: send one"
        " message, receive its echo, timed per round trip with `time.perf_counter()`; p50 and"
        " p99 are taken within a trial, the table's median and p95 across trials."
        " aiospawn: `ctx.channel(0)` on the event loop, the rank in a blocking"
        " `aiospawn.channel()` loop. raw socket on the loop: a socket pair written and read on"
        " the event loop with `anyio.wait_writable` / `wait_readable`, the floor of any"
        " event-loop transport (the process uses a `Connection`). raw Pipe / mp.Queue, loop"
        " in a thread: a blocking loop in one `anyio.to_thread.run_sync` call, timed inside it"
        " (the floor the targets name). raw Pipe, to_thread"
        " per message: one `anyio.to_thread.run_sync` per round trip."
    )
    result.note(
        "Throughput: a stream of 1 MB messages to the rank (it acknowledges the last), then one"
        " from it; MB/s, higher is better (the ratio column divides the best by each)."
        " Event-loop lag: a task sleeping 1 ms in a loop records how late each wake-up is while"
        " 1 GB streams (two ranks, both directions at once); the raw-pipe peer streams the same"
        " in two worker threads; idle: the ticker alone for 1 s."
        " Collective call: `ctx.call('ping')` on 8 ranks running `aiospawn.serve()` (and on"
        " rank 0 alone), against the raw floor: a request down each of 8 pipes, then each reply."
    )


def _sink_blocking(pipe: Blocking, count: int) -> None:
    payload = bytes(LARGE)
    pipe.send(("sink", count))
    for _ in range(count):
        pipe.send(payload)
    pipe.receive()


def _emit_blocking(pipe: Blocking, count: int) -> None:
    pipe.send(("emit", count, LARGE))
    for _ in range(count):
        pipe.receive()
