"""Ranks for test_supervision: restarts, hangs, heartbeats and the torchrun environment."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

import aiospawn


def fail_first_runs(rank: int, failing: int, runs: int) -> tuple[int, int, str]:
    """Rank ``failing`` raises in its first ``runs`` runs; every rank reports its restart count."""
    if rank == failing and aiospawn.restart_count() < runs:
        raise ValueError(f"rank {rank} fails in run {aiospawn.restart_count()}")
    return rank, aiospawn.restart_count(), os.environ["AIOSPAWN_RESTART_COUNT"]


def always_fail(rank: int) -> None:
    raise ValueError(f"rank {rank} always fails")


def run_until_stopped_unless_failing(rank: int, failing: int, report: Any) -> None:
    """Report ``(rank, restart, pid)``; rank ``failing`` then fails in its first run."""
    report.send((rank, aiospawn.restart_count(), os.getpid()))
    if rank == failing and aiospawn.restart_count() == 0:
        raise ValueError("first run fails")
    while True:
        time.sleep(3600)


def wait_for_peer_in_a_busy_loop() -> None:
    while True:
        pass


def beat_then(rank: int, how: str) -> None:
    """Beat for a moment, then hang ``how``: ``"busy"``, ``"sleep"`` or ``"blocked"``."""
    for _ in range(5):
        aiospawn.heartbeat()
        time.sleep(0.01)
    if how == "busy":
        wait_for_peer_in_a_busy_loop()
    elif how == "sleep":
        time.sleep(3600)
    else:  # every signal blocked, then a read that never returns
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        read_end, _write_end = os.pipe()
        os.read(read_end, 1)


def hang_in_first_run(rank: int) -> int:
    """Beat, then stop beating in the first run; return the restart count in a later one."""
    aiospawn.heartbeat()
    if aiospawn.restart_count() == 0:
        time.sleep(3600)
    return aiospawn.restart_count()


def never_beat(rank: int) -> None:
    time.sleep(3600)


def beat_and_return(rank: int, beats: int) -> int:
    for _ in range(beats):
        aiospawn.heartbeat()
    return rank


def torchrun_variables(rank: int) -> dict[str, str]:
    """The torchrun variables this rank sees; rank 0 also binds MASTER_PORT, as a store would."""
    names = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "AIOSPAWN_RESTART_COUNT",
    ]
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            sock.listen()
    return {name: os.environ[name] for name in names}


def port_after_first_run(rank: int, report: Any) -> str:
    """Report ``(restart, MASTER_PORT)`` in every run; rank 0 fails in the first."""
    port = os.environ["MASTER_PORT"]
    report.send((aiospawn.restart_count(), port))
    if aiospawn.restart_count() == 0 and rank == 0:
        raise ValueError("first run fails")
    return port + "/" + os.environ["TORCHELASTIC_RESTART_COUNT"]


def return_quickly(rank: int) -> int:
    return rank


def print_then_fail(rank: int) -> None:
    print(f"rank {rank} run {aiospawn.restart_count()}", flush=True)
    raise ValueError("fails")


def beat_until_sigterm(rank: int, report: Any) -> None:
    """Beat until SIGTERM; then take a second (beating no more) and exit with 0."""

    def on_sigterm(signum: int, frame: Any) -> None:
        time.sleep(1)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    aiospawn.heartbeat()
    report.send(("beating", rank, os.getpid()))
    while True:
        aiospawn.heartbeat()
        time.sleep(0.01)


class EnvOnce:
    """An env callable that works for the group's first start only, as if devices ran out."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rank: int) -> dict[str, str]:
        self.calls += 1
        if self.calls > 1:
            raise OSError("no more devices")
        return {}
