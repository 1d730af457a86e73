"""Starting ranks (``aiospawn._local._strategy``): concurrent starts, threads that exit,
parent death, and start failures."""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import aiospawn
from tests import ranks
from tests.helpers import live_children, wait_until

ROOT = Path(__file__).resolve().parent.parent


def is_alive(process: int | psutil.Process) -> bool:
    """True if the process runs (a zombie has ended: it only awaits its reaper)."""
    try:
        if isinstance(process, int):
            process = psutil.Process(process)
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.alone  # it bounds a duration
async def test_ranks_start_side_by_side(start_method: str) -> None:
    """Four ranks whose start blocks for an import second start in about one second.

    The duration is the point here. With 1 MB of ``args`` (more than the 64 KiB
    pipe buffer), ``Process.start()`` returns only once the child has read its
    arguments, which it does after importing ``fn``'s module (1 s, see
    tests/slow_import_module.py). Started one after another, the call would
    take at least 4 s; started side by side, about 1 s plus interpreter
    start-ups. The bound is generous for a busy machine but below 4 s.
    """
    slow = importlib.import_module("tests.slow_import_module")  # its import takes 1 s
    nprocs = 4
    payload = b"x" * (1 << 20)
    started = time.monotonic()
    results = await aiospawn.start_processes(
        slow.payload_size, (payload,), nprocs=nprocs, start_method=start_method
    )
    elapsed = time.monotonic() - started
    assert results == [len(payload)] * nprocs
    sequential = nprocs * slow.IMPORT_SECONDS
    assert elapsed < 3.5 < sequential, f"{nprocs} ranks took {elapsed:.2f} s to start and run"


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_group_started_from_a_thread_outlives_the_thread(
    anyio_backend: str, start_method: str
) -> None:
    """The pdeathsig hazard (docs/architecture.md): a rank outlives the thread that started it.

    ``PR_SET_PDEATHSIG`` fires when the thread that forked the child exits. Here
    an event loop on a short-lived thread starts the group and returns; the
    thread (and on asyncio, anyio's worker threads that did the forking) end.
    Trio keeps its worker threads for 10 s, so the rank also reports that no
    parent-death signal is set at all.
    """
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    ours = [a for a, _ in pipes]
    theirs = [b for _, b in pipes]
    groups: list[aiospawn.AsyncProcessContext[None]] = []

    async def start() -> None:
        groups.append(
            await aiospawn.start_processes(
                ranks.launch_ping,
                (theirs,),
                nprocs=2,
                join=False,
                start_method=start_method,
                grace_period=5,
            )
        )

    threads_before = set(threading.enumerate())
    thread = threading.Thread(target=anyio.run, args=(start,), kwargs={"backend": anyio_backend})
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "deadlock: starting the group on a thread did not finish"
    assert len(groups) == 1
    ctx = groups[0]
    try:
        if anyio_backend == "asyncio":
            assert wait_until(lambda: set(threading.enumerate()) <= threads_before), (
                "anyio's worker threads outlived their event loop"
            )
        pids = ctx.pids()
        for conn, pid in zip(ours, pids, strict=True):
            assert conn.poll(30), "no 'ready' from a rank"
            assert conn.recv() == ("ready", pid, 0)  # 0: no parent-death signal
            assert is_alive(pid)
        for conn, pid in zip(ours, pids, strict=True):
            conn.send("ping")
            assert conn.poll(30), "no 'pong' from a rank"
            assert conn.recv() == ("pong", "ping")
            assert is_alive(pid)
    finally:
        # The group's own shutdown reaps the ranks and closes the group's fds
        # (an os.waitpid here would take the exit status from under its watcher).
        anyio.run(ctx.terminate, backend=anyio_backend)
        for conn in ours + theirs:
            conn.close()
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGTERM] * 2


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_ranks_die_with_their_sigkilled_supervisor(anyio_backend: str, start_method: str) -> None:
    """SIGKILL the supervising process: its ranks (and its forkserver) exit within moments.

    The contract is about a second; 5 s is the generous bound.
    """
    command = [sys.executable, "-m", "tests.supervisor_script", start_method, anyio_backend]
    descendants: list[psutil.Process] = []
    with (
        # A SIGKILLed process leaves its temp dir (its forkserver's socket) behind.
        tempfile.TemporaryDirectory() as tmp,
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": tmp},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as supervisor,
    ):
        try:
            line = _read_line_within(supervisor, 60)
            pids = json.loads(line)["pids"]
            assert len(pids) == 2
            descendants = psutil.Process(supervisor.pid).children(recursive=True)
            assert set(pids) <= {p.pid for p in descendants}
            if start_method == "forkserver":
                forkserver = psutil.Process(pids[0]).ppid()
                assert forkserver not in (supervisor.pid, *pids)
                assert forkserver in {p.pid for p in descendants}
            os.kill(supervisor.pid, signal.SIGKILL)
            assert supervisor.wait(30) == -signal.SIGKILL
            assert wait_until(lambda: not any(map(is_alive, descendants)), 5.0), (
                "still running 5 s after their supervisor was SIGKILLed: "
                f"{sorted(p.pid for p in descendants if is_alive(p))} (ranks: {pids})"
            )
        finally:
            if supervisor.poll() is None:  # a failure above: let it shut its group down
                supervisor.stdin.close()  # type: ignore[union-attr]
                supervisor.wait(60)
            for process in descendants:  # orphans we failed to see die are ours to stop
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()


def _read_line_within(process: subprocess.Popen[str], seconds: float) -> str:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()))  # type: ignore[union-attr]
    reader.start()
    reader.join(seconds)
    if not lines or not lines[0]:
        process.kill()
        reader.join()
        pytest.fail(f"the supervisor printed no pids within {seconds} s")
    return lines[0]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_args_that_cannot_be_pickled_fail_the_start_and_leave_no_process(
    start_method: str,
) -> None:
    children = live_children()
    lock: Any = threading.Lock()
    with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object") as info:
        await aiospawn.start_processes(
            ranks.identity, (lock,), nprocs=2, start_method=start_method, grace_period=1
        )
    assert info.value.__notes__ == ["aiospawn: raised while starting rank 0 of 2"]
    assert live_children() == children
