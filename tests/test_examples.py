"""Every example in examples/ runs as a user would run it, and says what it promises."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .helpers import is_gone

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str) -> str:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_every_example_is_covered() -> None:
    assert {path.name for path in EXAMPLES.glob("*.py")} == set(EXPECTED) | SERVED


#: Examples that serve until stopped, each driven by a test of its own below.
SERVED = {"http_service.py"}


EXPECTED = {
    "quickstart.py": ["rank 0 (pid", "computed 100", "rank 3 (pid", "computed 109"],
    "open_group_cancel.py": [
        "started ranks with pids",
        "event loop: still responsive",
        "rank 0: got SIGTERM, shutting down cleanly",
        "rank 1: got SIGTERM, shutting down cleanly",
        "cancelled: True; every rank has been reaped",
    ],
    "failure.py": [
        "rank 1 (pid",
        "-- Process 1 terminated with the following error:",
        "ValueError: rank 1: loss became NaN at step 3",
        "the original exception is chained: ValueError('rank 1: loss became NaN at step 3')",
    ],
    "restart.py": [
        "rank 1: run 0, resuming at step 0",
        "event: Exited rank 1: raised",
        "event: Restarting rank 1",
        "rank 1: run 1, resuming at step 3",
        "results: [6, 6]; restarts: 1",
    ],
    "warm_start.py": [
        "rank 0: run 0, preloaded: True",
        "rank 1: run 1, preloaded: True",
        "every rank and the restart forked from one template: True",
        "a later group reuses it: True",
    ],
    "hang_detection.py": [
        "rank 1 (pid",
        "is hung: it sent no heartbeat for",
        "in wait_for_peer_that_never_comes",
        "in train",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_prints_what_it_promises(name: str) -> None:
    output = run_example(name)
    for expected in EXPECTED[name]:
        assert expected in output, f"{name} did not print {expected!r}:\n{output}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def http_service() -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    """examples/http_service.py serving on a free port, and a client for it, once it answers."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "http_service.py"), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            # The server binds its port only once every shard is ready: retry the connection.
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get("/health").raise_for_status()
                    break
                except httpx.TransportError:
                    assert server.poll() is None, server.communicate()[0]
                    assert time.monotonic() < deadline, "the service did not start in 60 s"
                    time.sleep(0.1)
            yield server, client
    finally:
        if server.poll() is None:  # the test failed before its Ctrl-C
            server.kill()
        server.communicate()


def test_http_service_survives_a_killed_shard_and_stops_on_ctrl_c(
    http_service: tuple[subprocess.Popen[str], httpx.Client],
) -> None:
    server, client = http_service
    assert client.get("/predict", params={"x": 2}).json() == {"y": 26.0, "shards": 4}
    before = [rank["pid"] for rank in client.get("/health").json()["ranks"]]

    os.kill(before[1], signal.SIGKILL)
    # While the group restarts (its backoff alone is 0.5 s), requests get a clear 503.
    statuses = []
    deadline = time.monotonic() + 60
    while not statuses or statuses[-1] != 200:
        assert time.monotonic() < deadline, f"no 200 within 60 s of the kill: {statuses}"
        response = client.get("/predict", params={"x": 2})
        statuses.append(response.status_code)
        if response.status_code == 503:
            assert "restarting" in response.json()["error"]
    assert statuses[0] == 503, statuses
    assert set(statuses) == {503, 200}, statuses
    assert response.json() == {"y": 26.0, "shards": 4}

    health = client.get("/health").json()
    assert health["healthy"]
    assert health["restarts"] == 1
    after = [rank["pid"] for rank in health["ranks"]]
    assert not set(after) & set(before)
    assert all(is_gone(pid) for pid in before)  # the restart stopped rank 1's siblings

    server.send_signal(signal.SIGINT)  # Ctrl-C
    output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output
    assert "shards stopped" in output
    assert all(is_gone(pid) for pid in after), output
