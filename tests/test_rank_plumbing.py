"""What a rank can do to the supervisor's plumbing, and what it holds of it.

A ``fork`` rank starts with a copy of the supervisor's descriptor table: it
must not keep its siblings' pipes, heartbeat memory or pidfds, nor the event
loop's epoll and wakeup pipe. A rank whose code closes every descriptor
(``os.closerange``, as daemonising code does) must neither be killed by its
own guard nor be reported as a success: its outcome is lost, and it says so.
And its guard must still kill it when the supervisor dies.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import aiospawn
from aiospawn._local import _pipes
from aiospawn._local._strategy import _loop_wakeup_sockets
from aiospawn._rank.fds import HIGH_FD
from aiospawn._rank.wire import LOST_CHANNEL_STATUS
from tests import hostile_ranks, ranks
from tests.conftest import wait_until
from tests.helpers import Events, receive, tripwire

pytestmark = pytest.mark.anyio

START_METHODS = ["spawn", "forkserver", "fork"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Made before the leak check's first baseline: not a leak of the first test.
    tmp_path_factory.getbasetemp()


def supervisor_pipes() -> set[str]:
    """The pipes (``pipe:[inode]``) that the supervisor holds for its ranks."""
    targets = set()
    for fd in list(_pipes.held()):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith("pipe:"):
            targets.add(target)
    return targets


def loop_sockets(loops: int = 1) -> set[str]:
    """The running loops' wakeup sockets (``socket:[inode]``): each loop has two."""
    sockets = _loop_wakeup_sockets()
    assert len(sockets) == 2 * loops, sockets
    return {os.readlink(f"/proc/self/fd/{sock.fileno()}") for sock in sockets}


def held_by(report: Any) -> set[str]:
    """What a rank's ``report_holdings`` report says it holds (``socket:[inode]``, ...)."""
    _kind, _rank, table, _heartbeats = report
    return {target for target, _mode in table.values()}


def wakeup_target() -> str | None:
    """What the event loop's signal wakeup fd is (``socket:[inode]``), if it has one."""
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return os.readlink(f"/proc/self/fd/{fd}") if fd >= 0 else None


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_rank_holds_its_own_plumbing_and_none_of_its_siblings(
    start_method: str, events: Events
) -> None:
    reader, writer = events
    ctx = await aiospawn.start_processes(
        hostile_ranks.report_holdings,
        (writer,),
        nprocs=3,
        join=False,
        start_method=start_method,
        stderr="prefix",
        heartbeat_timeout=600,
    )
    try:
        reports = [await receive(reader, "a rank's holdings") for _ in range(3)]
        ours = supervisor_pipes()
        wakeup = wakeup_target()
        loop = loop_sockets()
    finally:
        await ctx.terminate(grace_period=5)
    seen: dict[str, int] = {}
    for _kind, rank, table, heartbeats in sorted(reports, key=lambda report: report[1]):
        targets = [target for target, _mode in table.values()]
        assert "anon_inode:[eventpoll]" not in targets, f"rank {rank}: {table}"
        assert targets.count("anon_inode:[pidfd]") == 1, f"rank {rank}: {table}"  # the guard's
        # Its own slot, mapped (the mapping holds a duplicate of the memfd); no sibling's.
        memfds = [target for target in targets if "aiospawn-heartbeat" in target]
        assert len(memfds) == 1, f"rank {rank}: {table}"
        assert heartbeats == 1, f"rank {rank} maps {heartbeats} heartbeat slots"
        if wakeup is not None:
            assert wakeup not in targets, f"rank {rank} holds the loop's wakeup fd: {table}"
        assert not loop & set(targets), f"rank {rank} holds the loop's wakeup sockets: {table}"
        # The pipes shared with the supervisor's rank plumbing: the rank's own
        # write ends (result, stack dumps, stderr), never a read end, never a sibling's.
        shared = {fd: entry for fd, entry in table.items() if entry[0] in ours}
        assert sorted(fd for fd in shared if fd > 2) == sorted(
            fd for fd in shared if fd >= HIGH_FD
        ), f"rank {rank}: its descriptors are not moved high: {shared}"
        assert all(mode == os.O_WRONLY for _target, mode in shared.values()), shared
        assert len({target for target, _mode in shared.values()}) == 3, shared
        for target, _mode in shared.values():
            assert seen.setdefault(target, rank) == rank, f"ranks {seen[target]}, {rank}: {target}"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_fork_rank_holds_the_wakeup_sockets_of_no_loop_that_started_ranks(
    events: Events,
) -> None:
    reader, writer = events
    # This loop starts a fork group; then a loop in another thread starts one.
    assert await aiospawn.start_processes(ranks.identity, nprocs=1, start_method="fork") == [None]
    first = loop_sockets()

    async def second_loop() -> tuple[Any, set[str]]:
        ctx = await aiospawn.start_processes(
            hostile_ranks.report_holdings, (writer,), nprocs=1, join=False, start_method="fork"
        )
        try:
            return await receive(reader, "a rank's holdings"), loop_sockets()
        finally:
            await ctx.terminate(grace_period=5)

    with tripwire(60, "a fork group on a second event loop"):
        report, second = await anyio.to_thread.run_sync(asyncio.run, second_loop())
    assert first.isdisjoint(second)
    assert not (first | second) & held_by(report), held_by(report)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_trio_guest_on_an_asyncio_loop_supervises_fork_ranks(events: Events) -> None:
    """trio as this asyncio loop's guest: groups run on trio, ranks hold neither loop's sockets."""
    import trio

    reader, writer = events
    host = asyncio.get_running_loop()
    done: asyncio.Future[Any] = host.create_future()

    async def guest() -> tuple[list[int], aiospawn.ProcessRaisedException, Any, set[str]]:
        values = await aiospawn.start_processes(
            ranks.rank_times, (1,), nprocs=2, start_method="fork"
        )
        with pytest.raises(aiospawn.ProcessRaisedException) as failed:
            await aiospawn.start_processes(ranks.raise_in, (1,), nprocs=2, start_method="fork")
        ctx = await aiospawn.start_processes(
            hostile_ranks.report_holdings, (writer,), nprocs=1, join=False, start_method="fork"
        )
        try:
            report = await receive(reader, "a rank's holdings")
        finally:
            await ctx.terminate(grace_period=5)
        return values, failed.value, report, loop_sockets(loops=2)

    trio.lowlevel.start_guest_run(
        guest,
        run_sync_soon_threadsafe=host.call_soon_threadsafe,
        done_callback=done.set_result,
        host_uses_signal_set_wakeup_fd=True,
    )
    with tripwire(60, "fork groups in a trio guest run"):
        values, failure, report, both = (await done).unwrap()
    assert values == [0, 1]
    # The other rank was stopped (the shutdown's clean-up runs shielded, the trio way).
    assert failure.error_index == 1
    assert "legitimate exception from process 1" in str(failure)
    assert not both & held_by(report), held_by(report)


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_rank_that_closes_every_fd_then_returns_is_reported_as_lost(
    start_method: str,
) -> None:
    with (
        tripwire(60, "a group whose rank closed every descriptor"),
        pytest.raises(aiospawn.ProcessExitedException) as info,
    ):
        await aiospawn.start_processes(
            hostile_ranks.close_every_fd_then_return, nprocs=1, start_method=start_method
        )
    error = info.value
    # Not SIGKILLed by its own guard, not a success with None.
    assert (error.exit_code, error.signal_name) == (LOST_CHANNEL_STATUS, None)
    assert "closed the pipe on which it reports how fn ended" in error.msg
    assert "out-of-memory" not in error.msg


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_rank_that_closes_every_fd_keeps_its_own_exit_code(start_method: str) -> None:
    with pytest.raises(aiospawn.ProcessExitedException) as info:
        await aiospawn.start_processes(
            hostile_ranks.close_every_fd_then_exit, (3,), nprocs=1, start_method=start_method
        )
    assert (info.value.exit_code, info.value.signal_name) == (3, None)


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_the_frame_is_never_written_into_a_file_that_took_the_pipes_number(
    start_method: str, tmp_path: Path
) -> None:
    mine = tmp_path / "the-rank's-own-file"
    mine.write_bytes(b"")
    with pytest.raises(aiospawn.ProcessExitedException) as info:
        await aiospawn.start_processes(
            hostile_ranks.reuse_low_fds_then_return,
            (str(mine),),
            nprocs=1,
            start_method=start_method,
        )
    assert info.value.exit_code == LOST_CHANNEL_STATUS
    assert mine.read_bytes() == b""


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_rank_that_closed_every_fd_still_dies_with_its_supervisor(
    start_method: str, tmp_path: Path
) -> None:
    fifo = tmp_path / "report"
    os.mkfifo(fifo, 0o600)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiospawn",
            "run",
            "--start-method",
            start_method,
            "--fn",
            "tests.hostile_ranks:close_every_fd_then_wait",
            str(fifo),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        with subprocess.Popen(
            ["timeout", "60", "cat", str(fifo)], stdout=subprocess.PIPE, text=True
        ) as cat:
            # The handshake: the rank writes its pid once it has closed every descriptor.
            out, _ = cat.communicate(timeout=90)
        assert out, "the rank never reported"
        rank = int(out)
        # Its guard saw POLLNVAL; it must not have taken that for the supervisor's death.
        assert psutil.pid_exists(rank)
        assert launcher.poll() is None
        launcher.kill()
        launcher.wait(timeout=30)
        assert wait_until(lambda: hostile_is_gone(rank), 10), f"rank {rank} outlived its supervisor"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        assert launcher.stderr is not None
        launcher.stderr.close()


def hostile_is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
