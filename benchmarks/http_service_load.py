"""Throughput of examples/http_service.py: ``/predict`` against ``/health``.

``/predict`` makes one collective call on the example's 4 shard ranks;
``/health`` reads the group's statistics and calls no rank, so the
difference between the two is what a call costs the server. A standalone
script, not a ``run.py`` scenario: it starts the example (as a user runs it,
its access log on) on a free port, then drives it from a second process with
keep-alive connections, each sending its next request once the previous
answer is in. The client speaks raw HTTP/1.1 over asyncio streams, cheaper
than an HTTP library, so that it takes less of the machine from the server.
The endpoints alternate, one round each, ``--rounds`` times; every answer
must be a 200. It prints per round requests per second, p50 and p99 latency,
the CPU time the server and (apart) its ranks spent per request, steadier
than the rates on a shared machine, and the load average around it.

    .venv/bin/python benchmarks/http_service_load.py   # 10,000 requests, 32 at once, 3 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "http_service.py"
LENGTH = re.compile(rb"content-length: *(\d+)", re.IGNORECASE)


async def drive(port: int, path: str, requests: int, concurrency: int) -> list[float]:
    """Send ``requests`` GETs of ``path`` over ``concurrency`` connections; their latencies."""
    latencies: list[float] = []
    left = requests
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()

    async def connection() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left > 0:
                left -= 1
                sent = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = LENGTH.search(head)
                assert length is not None, head
                await reader.readexactly(int(length[1]))
                latencies.append(time.perf_counter() - sent)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"{path}: {head.decode()}")
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return latencies


def cpu_seconds(process: psutil.Process) -> float:
    """CPU time (user and system) that ``process`` has used so far."""
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def measure(server: psutil.Process, port: int, path: str, requests: int, concurrency: int) -> str:
    ranks = server.children()
    load = os.getloadavg()[0]
    cpu = [cpu_seconds(server), sum(map(cpu_seconds, ranks))]
    started = time.perf_counter()
    latencies = asyncio.run(drive(port, path, requests, concurrency))
    seconds = time.perf_counter() - started
    cpu = [cpu_seconds(server) - cpu[0], sum(map(cpu_seconds, ranks)) - cpu[1]]
    cuts = statistics.quantiles(latencies, n=100)
    per_request = [f"{part / len(latencies) * 1e6:,.0f} us" for part in cpu]
    return (
        f"| {path} | {len(latencies) / seconds:,.0f} | {cuts[49] * 1e3:.1f} ms"
        f" | {cuts[98] * 1e3:.1f} ms | {per_request[0]} | {per_request[1]}"
        f" | {load:.1f} -> {os.getloadavg()[0]:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLE), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # the port opens once every shard is ready
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the example did not start") from None
                time.sleep(0.2)
        process = psutil.Process(server.pid)
        measure(process, port, "/predict?x=2", 500, options.concurrency)  # warm-up
        print(
            f"{options.requests} requests, {options.concurrency} at once, {os.cpu_count()} cores\n"
        )
        print(
            "| endpoint | req/s | p50 | p99 | CPU per request: server | its ranks"
            " | load average (1 min) |\n|---|---|---|---|---|---|---|"
        )
        for _ in range(options.rounds):
            for path in ("/predict?x=2", "/health"):
                row = measure(process, port, path, options.requests, options.concurrency)
                print(row, flush=True)
    finally:
        server.terminate()  # SIGTERM: uvicorn stops, then the example stops its shards
        server.wait(60)


if __name__ == "__main__":
    main()
