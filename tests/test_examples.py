"""Every example in examples/ runs as a user would run it, and says what it promises."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
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


def example_module(name: str) -> Any:
    """The example imported as a module (its ``__main__`` block does not run): its constants."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HTTP_SERVICE = example_module("http_service.py")
#: The longest a client may wait for any answer: the example's call timeout
#: (a silent shard answers 504 then), plus a margin for a loaded 2-core machine.
HELD_BOUND = HTTP_SERVICE.CALL_TIMEOUT + 1.0
#: The longest Ctrl-C may take with a shard stuck: the requests in flight end
#: within the call timeout, the stuck shard is killed a grace period after
#: its SIGTERM; the rest is margin.
STOP_BOUND = HTTP_SERVICE.CALL_TIMEOUT + HTTP_SERVICE.GRACE_PERIOD + 5.0


@dataclass
class Service:
    """examples/http_service.py serving on a free port, a client for it, its output so far."""

    server: subprocess.Popen[str]
    client: httpx.Client
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    #: Every rank pid the test saw, with its start time: the only processes it may kill.
    ranks_seen: dict[int, float] = field(default_factory=dict)

    def read_output(self) -> None:
        assert self.server.stdout is not None
        for line in self.server.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for_output(self, text: str, seconds: float) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: text in "".join(self.lines), seconds):
                pytest.fail(f"the service did not print {text!r} within {seconds} s")

    def health(self) -> httpx.Response:
        response = self.client.get("/health")
        for rank in response.json()["ranks"]:
            if rank["pid"] is not None and rank["pid"] not in self.ranks_seen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.ranks_seen[rank["pid"]] = psutil.Process(rank["pid"]).create_time()
        return response

    def pids(self) -> list[int]:
        return [rank["pid"] for rank in self.health().json()["ranks"]]

    def stop(self, seconds: float) -> float:
        """Send Ctrl-C (SIGINT); return how long the server took to exit."""
        sent = time.monotonic()
        self.server.send_signal(signal.SIGINT)
        try:
            self.server.wait(seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the service still ran {seconds} s after Ctrl-C:\n{self.output()}")
        return time.monotonic() - sent


@pytest.fixture
def http_service() -> Iterator[Service]:
    """examples/http_service.py serving on a free port, once it answers."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "http_service.py"), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    service = Service(server, client)
    reader = threading.Thread(target=service.read_output, daemon=True)
    reader.start()
    try:
        # The server binds its port only once every shard is ready: retry the connection.
        deadline = time.monotonic() + 60
        while True:
            try:
                service.health().raise_for_status()
                break
            except httpx.TransportError:
                assert server.poll() is None, service.output()
                assert time.monotonic() < deadline, "the service did not start in 60 s"
                time.sleep(0.1)
        yield service
    finally:
        client.close()
        if server.poll() is None:  # the test failed before the server stopped
            server.kill()
        server.wait()
        reader.join(30)
        assert server.stdout is not None
        server.stdout.close()
        # A rank the test stopped (SIGSTOP) cannot act on its supervisor's
        # death: continue and kill those left, ours only (same pid, same start).
        for pid, started in service.ranks_seen.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                rank = psutil.Process(pid)
                if rank.create_time() == started:
                    rank.resume()
                    rank.kill()


@dataclass(frozen=True)
class Answer:
    x: float
    sent: float  # time.monotonic()
    seconds: float
    status: int | None  # None: no HTTP answer (the connection failed)
    body: Any


class Load:
    """A few clients asking ``/predict`` in a loop, each on a connection of its own."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.answers: list[Answer] = []
        self.changed = threading.Condition()
        self.done = threading.Event()
        self.numbers = itertools.count()
        self.threads = [threading.Thread(target=self.ask, args=(url,)) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(60)
            assert not thread.is_alive(), "deadlock: a client is still waiting 60 s after the test"

    def ask(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not self.done.is_set():
                x = float(next(self.numbers) % 100)
                sent = time.monotonic()
                try:
                    response = client.get("/predict", params={"x": x})
                    status, body = response.status_code, response.json()
                except httpx.TransportError as exc:
                    status, body = None, repr(exc)
                answer = Answer(x, sent, time.monotonic() - sent, status, body)
                with self.changed:
                    self.answers.append(answer)
                    self.changed.notify_all()

    def wait(self, what: str, until: Callable[[list[Answer]], bool], seconds: float = 60) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: until(self.answers), seconds):
                statuses = [answer.status for answer in self.answers]
                pytest.fail(f"no {what} within {seconds} s; statuses: {statuses}")


def right(answer: Answer) -> bool:
    """The four stand-in shards answer sum((rank + 1) * x + rank) = 10 x + 6."""
    return answer.status == 200 and answer.body == {"y": 10 * answer.x + 6, "shards": 4}


@pytest.mark.alone  # it bounds how long a request waits
def test_http_service_answers_503_until_the_restarted_shards_are_ready(
    http_service: Service,
) -> None:
    service = http_service
    before = service.pids()
    with Load(str(service.client.base_url)) as load:
        load.wait("20 answers", lambda answers: len(answers) >= 20)
        killed = time.monotonic()
        os.kill(before[1], signal.SIGKILL)
        # /health says 503 until every shard of the new attempt is ready.
        healths = []
        deadline = time.monotonic() + 60
        while not healths or healths[-1].status_code != 200 or healths[-1].json()["restarts"] < 1:
            assert time.monotonic() < deadline, f"not healthy 60 s after the kill: {healths}"
            healths.append(service.health())
        healthy = time.monotonic()
        load.wait(
            "20 answers after the restart",
            lambda answers: sum(answer.sent > healthy for answer in answers) >= 20,
        )

    assert any(response.status_code == 503 for response in healths), healths
    for response in healths:
        ready = [rank["ready"] for rank in response.json()["ranks"]]
        assert (response.status_code == 200) == all(ready), response.json()
    assert not set(service.pids()) & set(before)
    assert all(is_gone(pid) for pid in before)  # the restart stopped rank 1's siblings

    answers = load.answers
    wrong = [a for a in answers if a.status != 503 and not right(a)]
    assert not wrong, wrong[:5]
    assert all("restarting" in a.body["error"] for a in answers if a.status == 503)
    statuses = [a.status for a in answers if a.sent > killed]
    assert 503 in statuses, statuses
    assert statuses[-1] == 200, statuses
    assert all(a.status == 200 for a in answers if a.sent + a.seconds < killed)
    assert all(a.status == 200 for a in answers if a.sent > healthy)
    slowest = max(answers, key=lambda answer: answer.seconds)
    assert slowest.seconds < HELD_BOUND, slowest

    service.stop(STOP_BOUND)
    assert service.server.returncode == 0, service.output()
    assert "shards stopped" in service.output()
    assert all(is_gone(pid) for pid in service.ranks_seen), service.output()


@pytest.mark.alone  # it bounds a duration
def test_http_service_stops_on_ctrl_c_with_a_shard_stuck(http_service: Service) -> None:
    service = http_service
    pids = service.pids()
    os.kill(pids[2], signal.SIGSTOP)  # stuck: it never answers, and ignores SIGTERM
    with Load(str(service.client.base_url)) as load:
        # A call that rank 2 never answers gets the client a 504, not a wait.
        load.wait("504", lambda answers: any(answer.status == 504 for answer in answers))
        service.stop(STOP_BOUND)  # with calls to rank 2 in flight
    assert service.server.returncode == 0, service.output()
    assert "shards stopped" in service.output()
    assert all(is_gone(pid) for pid in pids), service.output()

    answers = [a for a in load.answers if a.status is not None]
    assert {a.status for a in answers} == {504}, answers
    slowest = max(answers, key=lambda answer: answer.seconds)
    assert slowest.seconds < HELD_BOUND, slowest


def test_http_service_kills_stuck_shards_at_once_on_a_second_ctrl_c(
    http_service: Service,
) -> None:
    service = http_service
    pids = service.pids()
    os.kill(pids[2], signal.SIGSTOP)
    service.server.send_signal(signal.SIGINT)
    # The shards' SIGTERM has been sent, or is about to be: Ctrl-C again.
    service.wait_for_output("stopping the shards", 30)
    service.stop(STOP_BOUND)
    assert service.server.returncode == 0, service.output()
    assert all(is_gone(pid) for pid in pids), service.output()
    # The stuck rank ignores SIGTERM: the SIGKILL came before its grace period ended.
    killed = re.search(
        rf"Process {pids[2]} \(rank 2\) still running ([0-9.]+) s after SIGTERM; sending SIGKILL",
        service.output(),
    )
    assert killed is not None, service.output()
    assert float(killed[1]) < HTTP_SERVICE.GRACE_PERIOD, service.output()
