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
from aiospawn._local._starters import START_CONCURRENCY
from tests import ranks
from tests.helpers import is_reaped, live_children, wait_until

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
def test_a_group_started_on_a_short_lived_thread_lives_as_long_as_its_loop(
    anyio_backend: str, start_method: str
) -> None:
    """The pdeathsig hazard (docs/architecture.md): no rank dies with the thread that forked it.

    ``PR_SET_PDEATHSIG`` fires when the thread that forked the child exits. Here
    an event loop on a short-lived thread starts the group: the ranks report
    that no parent-death signal is set, and answer while the loop runs. When
    the loop ends, its group's owner stops the ranks (SIGTERM) and reaps them
    before the thread is gone.
    """
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    ours = [a for a, _ in pipes]
    theirs = [b for _, b in pipes]
    groups: list[aiospawn.AsyncProcessContext[None]] = []
    finish = threading.Event()

    async def run() -> None:
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
        await anyio.to_thread.run_sync(finish.wait)

    threads_before = set(threading.enumerate())
    thread = threading.Thread(target=anyio.run, args=(run,), kwargs={"backend": anyio_backend})
    thread.start()
    try:
        assert wait_until(lambda: groups, 60), "deadlock: starting the group on a thread"
        ctx = groups[0]
        pids = ctx.pids()
        for conn, pid in zip(ours, pids, strict=True):
            assert conn.poll(30), "no 'ready' from a rank"
            assert conn.recv() == ("ready", pid, 0)  # 0: no parent-death signal
        for conn in ours:
            conn.send("ping")
            assert conn.poll(30), "no 'pong' from a rank"
            assert conn.recv() == ("pong", "ping")
    finally:
        finish.set()
        thread.join(60)
        for conn in ours + theirs:
            conn.close()
    assert not thread.is_alive(), "deadlock: the loop's end did not stop its group"
    assert all(is_reaped(pid) for pid in pids)
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGTERM] * 2
    if anyio_backend == "asyncio":
        # The starter threads are the process's, kept idle between groups
        # (at most START_CONCURRENCY, whatever the loops); anyio's belong to the loop.
        def starter(thread: threading.Thread) -> bool:
            return thread.name.startswith("aiospawn-start")

        assert wait_until(
            lambda: {t for t in threading.enumerate() if not starter(t)} <= threads_before
        ), "anyio's worker threads outlived their event loop"
        assert len([t for t in threading.enumerate() if starter(t)]) <= START_CONCURRENCY


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
