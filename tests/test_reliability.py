"""Stress, fault and hostile-input tests: what aiospawn leaves behind under pressure.

Each test drives many groups through faults (cancellations at random points,
failures, load, bad arguments) and then checks what every caller relies on:
no child or zombie left, no pipe or pidfd open, no thread blocked in our code,
no temp file, exact exit codes.

Random choices come from one ``random.Random`` whose seed is printed (shown with
a failure's captured output); ``AIOSPAWN_SEED=<seed>`` replays the same choices.
``AIOSPAWN_STRESS=<float>`` multiplies every iteration count (default 1).
Random delays here pick *where* a cancellation lands; they never synchronize.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import psutil
import pytest

import aiospawn
from tests import ranks
from tests.helpers import live_children, open_fds

pytestmark = pytest.mark.anyio

SUPERVISOR = Path(__file__).resolve().parent / "reliability_supervisor.py"
STRESS = float(os.environ.get("AIOSPAWN_STRESS", "1"))


def scaled(count: int) -> int:
    """``count`` times ``AIOSPAWN_STRESS``, at least 1."""
    return max(1, int(count * STRESS))


def make_rng(name: str) -> random.Random:
    """A seeded generator; the seed is printed so that a failure can be replayed."""
    seed = int(os.environ.get("AIOSPAWN_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{name}: seed {seed} (replay with AIOSPAWN_SEED={seed})")
    return random.Random(seed)


# --- observation helpers -----------------------------------------------------


#: Where aiospawn's own modules are (not any path that happens to contain "aiospawn").
PACKAGE_DIR = os.path.dirname(aiospawn.__file__) + os.sep


def our_threads_blocked() -> list[str]:
    """Threads (other than this one) that are inside aiospawn or a multiprocessing wait."""
    blocked = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = []
        current: Any = frame
        while current is not None:
            stack.append(current.f_code)
            current = current.f_back
        for code in stack:
            path = code.co_filename
            ours = path.startswith(PACKAGE_DIR)
            mp_wait = "/multiprocessing/" in path and code.co_name in ("join", "wait", "poll")
            if ours or mp_wait:
                blocked.append(f"thread {ident}: {path}:{code.co_name}")
                break
    return blocked


def idle_thread_bound() -> int:
    """How many idle worker threads anyio may legitimately keep (its default limiter)."""
    return int(anyio.to_thread.current_default_thread_limiter().total_tokens)


def all_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class Inbox:
    """Collects the small messages ranks send on one pipe, without blocking the loop."""

    def __init__(self, reader: Connection) -> None:
        self.reader = reader
        self.seen: Counter[str] = Counter()
        self.pids: set[int] = set()

    async def wait_for(self, kind: str, count: int) -> None:
        while self.seen[kind] < count:
            await anyio.wait_readable(self.reader.fileno())
            self._take()

    def drain(self) -> None:
        while self.reader.poll():
            self._take()

    def _take(self) -> None:
        # Each message is one write of a few bytes, so a readable pipe holds a
        # whole message and recv() does not block.
        kind, _rank, pid = self.reader.recv()
        self.seen[kind] += 1
        self.pids.add(pid)


async def first_of(main: Callable[[], Awaitable[None]], done: anyio.Event) -> bool:
    """Run ``main()``; True if it finished, False if ``done`` was set first."""
    finished = False
    async with anyio.create_task_group() as tg:

        async def stop_when_done() -> None:
            await done.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(stop_when_done)
        await main()
        finished = True
        tg.cancel_scope.cancel()
    return finished


@pytest.fixture
def private_tempdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Point the temp dir (here and in spawned ranks) at an empty private directory."""
    path = tempfile.mkdtemp(prefix="aiospawn-rel-")
    monkeypatch.setattr(tempfile, "tempdir", path)
    monkeypatch.setenv("TMPDIR", path)
    try:
        yield path
    finally:
        left = os.listdir(path)
        shutil.rmtree(path)
    assert not left, f"files left in the temp dir: {left}"


# --- 1. cancellation storms ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    """One group, cancelled at one point in its life."""

    index: int
    method: str
    nprocs: int
    #: "start_processes" (join=True), "join" (join=False, then ctx.join()), "open_group"
    api: str
    #: "start": after ``checkpoints`` event-loop turns, then ``delay`` seconds, often
    #: mid-start; "running": once every rank runs;
    #: "twice": once running, two cancellations back to back; "grace": once running,
    #: a second cancellation while the ranks (which survive SIGTERM) are in their grace period
    point: str
    #: cancel with asyncio's Task.cancel() (asyncio only), else with an anyio cancel scope
    native: bool
    checkpoints: int
    delay: float
    #: for "start": also cancel a second time right after the first
    double: bool
    grace: float

    def __str__(self) -> str:
        how = "Task.cancel()" if self.native else "anyio scope"
        extra = ""
        if self.point == "start":
            extra = (
                f" after {self.checkpoints} checkpoints + {self.delay:.4f}s double={self.double}"
            )
        return (
            f"trial {self.index}: {self.method} nprocs={self.nprocs} api={self.api}"
            f" point={self.point}{extra} via {how} grace={self.grace}"
        )


def draw_trial(rng: random.Random, index: int, backend: str) -> Trial:
    method = "spawn" if rng.random() < 0.15 else "fork"
    point = rng.choice(["start", "running", "twice", "grace"])
    return Trial(
        index=index,
        method=method,
        nprocs=rng.choice([1, 2]),
        api=rng.choice(["start_processes", "join", "open_group"]),
        point=point,
        native=backend == "asyncio" and rng.random() < 0.5,
        # Half land within a few loop turns, half after a short delay as well:
        # a fork start takes a few ms per rank, a spawn start ~60 ms.
        checkpoints=int(30 ** rng.random()) - 1,  # 0..28, log-uniform: mostly few
        delay=0.0 if rng.random() < 0.5 else rng.uniform(0, 0.01 if method == "fork" else 0.08),
        double=rng.random() < 0.5,
        grace=rng.choice([0.05, 0.2]) if point == "grace" else 10.0,
    )


async def run_trial(trial: Trial) -> str:
    """Run one trial and check everything it must leave behind (nothing).

    Returns:
        Where the cancellation landed, as far as the test can tell.
    """
    children_before = live_children()
    reader, writer = multiprocessing.get_context(trial.method).Pipe(duplex=False)
    inbox = Inbox(reader)
    try:
        return await _run_trial(trial, reader, writer, inbox, children_before)
    finally:
        reader.close()
        writer.close()


async def _run_trial(
    trial: Trial,
    reader: Connection,
    writer: Connection,
    inbox: Inbox,
    children_before: set[int],
) -> str:
    fn = ranks.rel_notice_term if trial.point == "grace" else ranks.rel_ready_sleep
    contexts: list[aiospawn.AsyncProcessContext[Any]] = []
    outcome: list[object] = []
    done = anyio.Event()

    async def victim() -> None:
        options: dict[str, Any] = {"start_method": trial.method, "grace_period": trial.grace}
        if trial.api == "start_processes":
            await aiospawn.start_processes(fn, (writer,), trial.nprocs, **options)
        elif trial.api == "join":
            ctx = await aiospawn.start_processes(fn, (writer,), trial.nprocs, join=False, **options)
            contexts.append(ctx)
            await ctx.join()
        else:
            async with aiospawn.open_group(fn, (writer,), trial.nprocs, **options) as ctx:
                contexts.append(ctx)
                await anyio.sleep_forever()

    async def first_trigger() -> None:
        if trial.point == "start":
            # Each checkpoint lets the group's start take one step (a fork
            # start is a checkpoint, then a fork on the loop's thread, per rank).
            for _ in range(trial.checkpoints):
                await anyio.lowlevel.checkpoint()
            if trial.delay:
                await anyio.sleep(trial.delay)
        else:
            await inbox.wait_for("ready", trial.nprocs)

    async def second_trigger() -> bool:
        if trial.point == "grace":
            await inbox.wait_for("term", trial.nprocs)
            return True
        return trial.point == "twice" or (trial.point == "start" and trial.double)

    try:
        with anyio.fail_after(60):
            if trial.native:
                task = asyncio.get_running_loop().create_task(victim())
                task.add_done_callback(lambda _: done.set())
                cancel_first: Callable[[], object] = task.cancel
                cancel_second: Callable[[], object] = task.cancel
            else:
                inner, outer = anyio.CancelScope(), anyio.CancelScope()

                async def in_scopes() -> None:
                    try:
                        with outer, inner:
                            await victim()
                            outcome.append("returned")
                    except Exception as exc:
                        outcome.append(exc)
                    finally:
                        done.set()

                cancel_first, cancel_second = inner.cancel, outer.cancel

            async with anyio.create_task_group() as tg:
                if not trial.native:
                    tg.start_soon(in_scopes)
                if trial.point == "start":
                    # Directly, not through first_of(), whose own task would
                    # cost loop turns: the group cannot end by itself meanwhile.
                    await first_trigger()
                elif not await first_of(first_trigger, done):
                    ended = task if trial.native else outcome
                    raise AssertionError(f"{trial}: ended before its cancellation: {ended}")
                cancel_first()
                if await first_of(second_trigger, done):
                    cancel_second()
                await done.wait()
    except TimeoutError:
        raise AssertionError(f"{trial}: deadlocked for 60 s") from None

    if trial.native:
        assert task.cancelled(), f"{trial}: the task was not cancelled: {task}"
    else:
        # The scope swallowed the cancellation; nothing else may have come out.
        assert outcome == [], f"{trial}: expected a cancellation, got {outcome!r}"

    # Invariant 2: every rank was reaped before the call returned: no retry here.
    left = live_children() - children_before
    assert not left, f"{trial}: processes left behind: {sorted(left)}"
    inbox.drain()
    for pid in inbox.pids:
        assert not psutil.pid_exists(pid), f"{trial}: rank pid {pid} still exists"
    for ctx in contexts:
        codes = [process.exitcode for process in ctx.processes]
        expected = -9 if trial.point == "grace" else -15
        assert codes == [expected] * trial.nprocs, f"{trial}: exit codes {codes}"
    if trial.api == "start_processes":
        return "in start_processes()"
    return "after the start" if contexts else "during the start"


@pytest.mark.parametrize(
    "iterations",
    [pytest.param(16, id="quick"), pytest.param(200, id="full", marks=pytest.mark.slow)],
)
async def test_cancellation_storm_leaves_nothing_behind(
    anyio_backend: str, iterations: int, private_tempdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancel groups at random points, by scope and by Task.cancel(), once and twice."""
    caplog.set_level("ERROR", logger="aiospawn")  # thousands of expected SIGTERM warnings
    rng = make_rng(f"cancellation storm ({anyio_backend})")
    fds_before = open_fds()
    threads_before = threading.active_count()
    kinds: Counter[str] = Counter()
    landed: Counter[str] = Counter()
    for index in range(scaled(iterations)):
        trial = draw_trial(rng, index, anyio_backend)
        print(trial)
        kinds[f"{trial.method}/{trial.point}/{'native' if trial.native else 'scope'}"] += 1
        landed[await run_trial(trial)] += 1
        # At once, without a garbage collection: each rank's fds close as it is reaped.
        assert open_fds() <= fds_before, f"{trial}: fds left: {sorted(open_fds() - fds_before)}"
        assert os.listdir(private_tempdir) == [], f"{trial}: temp files made"
    threads_after = threading.active_count()
    print(f"storm done: {sorted(kinds.items())}; cancellations landed {dict(landed)}")
    print(f"threads: {threads_before} before, {threads_after} after")
    assert our_threads_blocked() == []
    assert threads_after <= threads_before + idle_thread_bound()


def test_the_blocked_thread_detector_sees_a_thread_in_our_code() -> None:
    # A function whose code claims to live in aiospawn's _watch.py, parked on an event.
    namespace: dict[str, Any] = {}
    source = "def park(event):\n    event.wait()\n"
    exec(compile(source, os.path.join(PACKAGE_DIR, "_watch.py"), "exec"), namespace)
    release = threading.Event()
    thread = threading.Thread(target=namespace["park"], args=(release,))
    thread.start()
    try:
        assert any("aiospawn/_watch.py:park" in found for found in our_threads_blocked())
    finally:
        release.set()
        thread.join()
    assert our_threads_blocked() == []


# --- 3. load -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.alone  # it bounds a duration
async def test_256_running_ranks_are_torn_down_with_exact_exit_codes(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("ERROR", logger="aiospawn")
    nprocs = 256
    children_before = live_children()
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            ranks.rel_ready_sleep, (writer,), nprocs, join=False, start_method="fork"
        )
        inbox = Inbox(reader)
        with anyio.fail_after(120):  # tripwire: 256 forks on a busy machine
            await inbox.wait_for("ready", nprocs)
        pids = ctx.pids()
        assert len(set(pids)) == nprocs
        assert inbox.pids == set(pids)
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ctx.join)
            await anyio.wait_all_tasks_blocked()
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()
        teardown = time.monotonic() - cancelled_at

    print(f"{nprocs} ranks ({anyio_backend}): teardown after cancellation took {teardown:.3f} s")
    assert teardown < 5.0  # generous: the figure above is the measurement
    codes = [process.exitcode for process in ctx.processes]
    assert codes == [-15] * nprocs, Counter(codes)
    assert live_children() - children_before == set()
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


@pytest.mark.slow
async def test_a_thousand_start_fail_cancel_cycles_leak_nothing(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Small groups that succeed, fail or are cancelled: fds, threads and memory stay flat."""
    caplog.set_level("ERROR", logger="aiospawn")
    rng = make_rng(f"start/fail/cancel cycles ({anyio_backend})")
    cycles, warmup = scaled(1000), 50
    process = psutil.Process()
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    inbox = Inbox(reader)
    ready = 0
    fds_base = threads_base = rss_base = 0
    fds_peak_without_collect = 0
    kinds: Counter[str] = Counter()
    with reader, writer:
        for cycle in range(cycles + warmup):
            if cycle == warmup:
                gc.collect()
                fds_base, threads_base = all_fd_count(), threading.active_count()
                rss_base = process.memory_info().rss
            kind, nprocs = rng.choice(["succeed", "fail", "cancel"]), rng.choice([1, 2])
            kinds[kind] += 1
            if kind == "succeed":
                results = await aiospawn.start_processes(
                    ranks.rank_times, (3,), nprocs, start_method="fork"
                )
                assert results == [0, 3][:nprocs]
            elif kind == "fail":
                with pytest.raises(aiospawn.ProcessRaisedException) as info:
                    await aiospawn.start_processes(
                        ranks.rel_fail_or_sleep, (0,), nprocs, start_method="fork"
                    )
                assert info.value.error_index == 0
                del info
            else:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        partial(
                            aiospawn.start_processes,
                            ranks.rel_ready_sleep,
                            (writer,),
                            nprocs,
                            start_method="fork",
                        )
                    )
                    ready += nprocs
                    with anyio.fail_after(30):  # tripwire: the ranks never reported
                        await inbox.wait_for("ready", ready)
                    tg.cancel_scope.cancel()
            if cycle >= warmup:  # no garbage collection needed: fds close at reaping
                fds_now = all_fd_count()
                fds_peak_without_collect = max(fds_peak_without_collect, fds_now)
                assert fds_now == fds_base, f"cycle {cycle} ({kind}): {fds_now} fds"
        gc.collect()
        fds_end, threads_end = all_fd_count(), threading.active_count()
        rss_end = process.memory_info().rss

    growth_mb = (rss_end - rss_base) / 2**20
    print(
        f"{cycles} cycles ({anyio_backend}, {dict(kinds)}): fds {fds_base} -> {fds_end}"
        f" (peak {fds_peak_without_collect} without an explicit gc.collect()),"
        f" threads {threads_base} -> {threads_end}, RSS {rss_base / 2**20:.1f} MB ->"
        f" {rss_end / 2**20:.1f} MB (growth {growth_mb:+.2f} MB)"
    )
    assert fds_end == fds_base
    assert threads_end <= threads_base + idle_thread_bound()
    assert our_threads_blocked() == []
    assert growth_mb < 20


# --- the cyclic garbage collector is not a cleanup mechanism -----------------------


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("outcome", ["returned", "raised", "cancelled"])
async def test_a_finished_group_holds_no_fd_without_the_cyclic_gc(
    start_method: str, outcome: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the call has returned, raised or been cancelled, its fds are closed.

    Not when the group's objects are garbage-collected: they form reference
    cycles, and a long-lived group's cycle may wait for a full collection.
    """
    caplog.set_level("ERROR", logger="aiospawn")
    multiprocessing.resource_tracker.ensure_running()  # process-wide, not the group's
    reader, writer = multiprocessing.get_context(start_method).Pipe(duplex=False)
    fds = open_fds()
    gc.disable()
    try:
        if outcome == "returned":
            await aiospawn.start_processes(ranks.identity, (1,), 2, start_method=start_method)
        elif outcome == "raised":
            with pytest.raises(aiospawn.ProcessRaisedException):
                await aiospawn.start_processes(
                    ranks.rel_fail_or_sleep, (1,), 2, start_method=start_method
                )
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    partial(
                        aiospawn.start_processes,
                        ranks.rel_ready_sleep,
                        (writer,),
                        2,
                        start_method=start_method,
                    )
                )
                await Inbox(reader).wait_for("ready", 2)
                tg.cancel_scope.cancel()
        left = sorted(open_fds() - fds)
    finally:
        gc.enable()
        reader.close()
        writer.close()
    assert left == [], f"fds still open after the call {outcome}: {left}"


# --- 5. hostile input ----------------------------------------------------------------


class RefusesSecondPickle:
    """Pickles once (as ``b""``); the second attempt raises: one rank starts, the next cannot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pickled = 0

    def __reduce__(self) -> tuple[Any, ...]:
        with self._lock:
            self.pickled += 1
            if self.pickled > 1:
                raise RuntimeError("refuses to be pickled twice")
        return bytes, ()


# In a program whose __main__ is a file, arguments go by reference, as multiprocessing
# sends them; a lambda among them cannot.
unpicklable_lambda = lambda rank: rank  # noqa: E731  (a lambda cannot be pickled by name)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        pytest.param(threading.Lock(), TypeError, id="lock"),
        pytest.param(unpicklable_lambda, pickle.PicklingError, id="lambda"),
        pytest.param((n for n in [1]), TypeError, id="generator"),
    ],
)
async def test_arguments_that_cannot_be_pickled_are_reported_and_nothing_runs(
    start_method: str, bad: Any, error: type[Exception]
) -> None:
    children = live_children()
    with pytest.raises(error) as info:
        await aiospawn.start_processes(ranks.identity, (bad,), 2, start_method=start_method)
    assert any("raised while starting rank 0 of 2" in note for note in info.value.__notes__)
    assert live_children() == children


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_start_failing_part_way_stops_the_ranks_already_started(
    start_method: str, caplog: pytest.LogCaptureFixture
) -> None:
    children = live_children()
    reader, writer = multiprocessing.get_context(start_method).Pipe(duplex=False)
    with reader, writer:
        hostile = RefusesSecondPickle()
        with pytest.raises(RuntimeError, match="refuses to be pickled twice") as info:
            await aiospawn.start_processes(
                ranks.rel_fail_or_sleep, (hostile, writer), 2, start_method=start_method
            )
    assert hostile.pickled == 2
    assert any(re.search(r"starting rank [01] of 2", note) for note in info.value.__notes__)
    # The rank that did start was stopped and reaped before the call raised.
    assert live_children() == children
    stopped = [r.getMessage() for r in caplog.records if "via signal SIGTERM" in r.getMessage()]
    assert len(stopped) <= 1


def test_fn_defined_in_the_main_script_works_under_spawn() -> None:
    # A spawn rank imports the main script again (as __mp_main__) to find fn.
    done = subprocess.run(
        [sys.executable, str(SUPERVISOR), "main-fn"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[0, "hi", "__mp_main__"], [1, "hi", "__mp_main__"]]


@pytest.mark.slow
async def test_a_100_mb_argument_reaches_spawn_ranks() -> None:
    data = bytes(100 * 2**20)
    results = await aiospawn.start_processes(ranks.rel_len, (data,), 2, start_method="spawn")
    assert results == [len(data), len(data)]


@pytest.mark.parametrize("nprocs", [0, -1, 2.0, "2", None, True, [2]])
async def test_nprocs_that_is_not_a_positive_int_is_refused_before_any_fork(
    nprocs: Any, no_process_start: None
) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        await aiospawn.start_processes(ranks.identity, (), nprocs, start_method="fork")
    assert "nprocs" in str(info.value)
    assert repr(nprocs) in str(info.value)


async def test_nprocs_beyond_what_the_process_can_hold_names_the_limit(
    no_process_start: None,
) -> None:
    with pytest.raises(ValueError, match="nprocs") as info:
        await aiospawn.start_processes(ranks.identity, (), 10**6, start_method="fork")
    message = str(info.value)
    assert "1000000" in message
    limits = [int(number) for number in re.findall(r"\b\d+\b", message) if int(number) < 10**6]
    assert limits, f"the message does not name the limit: {message}"
    assert "RLIMIT_NOFILE" in message or "ulimit" in message


@pytest.mark.parametrize("seconds", [-1, -0.001, float("nan"), float("-inf")])
async def test_negative_seconds_are_refused_before_any_fork(
    seconds: float, no_process_start: None
) -> None:
    with pytest.raises(ValueError, match="grace_period"):
        await aiospawn.start_processes(
            ranks.identity, (), 1, start_method="fork", grace_period=seconds
        )
    with pytest.raises(ValueError, match="grace_period"):
        async with aiospawn.open_group(
            ranks.identity, (), 1, start_method="fork", grace_period=seconds
        ):
            pass


async def test_negative_seconds_on_a_running_group_are_refused_and_change_nothing() -> None:
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            ranks.rel_ready_sleep, (writer,), 2, join=False, start_method="fork"
        )
        try:
            await Inbox(reader).wait_for("ready", 2)
            for bad in (-1, float("nan")):
                with pytest.raises(ValueError, match="timeout"):
                    await ctx.join(timeout=bad)
                with pytest.raises(ValueError, match="grace_period"):
                    await ctx.join(timeout=0, grace_period=bad)
                with pytest.raises(ValueError, match="grace_period"):
                    await ctx.terminate(grace_period=bad)
            assert await ctx.join(timeout=0) is False
            assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in ctx.pids())
        finally:
            await ctx.terminate(grace_period=5)
    assert [process.exitcode for process in ctx.processes] == [-15, -15]


@pytest.mark.parametrize("method", ["spwan", "Spawn", "fork ", "", "thread", "forkserver\n"])
async def test_start_method_typos_are_refused_before_any_fork(
    method: str, no_process_start: None
) -> None:
    with pytest.raises(ValueError, match="start_method") as info:
        await aiospawn.start_processes(ranks.identity, (), 1, start_method=method)
    assert repr(method) in str(info.value)
    assert all(repr(valid) in str(info.value) for valid in ("spawn", "fork", "forkserver"))
    with pytest.raises(ValueError, match="start_method"):
        async with aiospawn.open_group(ranks.identity, (), 1, start_method=method):
            pass


def read_only_runner(path: str) -> list[str]:
    """A command prefix that runs a program for which ``path`` is read-only.

    Mode 0o555 is enough for an ordinary user; root ignores modes, so for root
    the directory is bind-mounted read-only in a mount namespace of its own.
    """
    os.chmod(path, 0o555)
    if os.geteuid() != 0:
        return []
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    runner = ["unshare", "--mount", "sh", "-c", script, path]
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare(1): cannot make a read-only directory")
    probe = subprocess.run([*runner, "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"running as root without mount namespaces: {probe.stderr!r}")
    return runner


def test_groups_run_with_a_read_only_temp_dir() -> None:
    read_only = tempfile.mkdtemp(prefix="aiospawn-rel-read-only-")
    try:
        done = subprocess.run(
            [*read_only_runner(read_only), sys.executable, str(SUPERVISOR), "read-only-tmp"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "TMPDIR": read_only},
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["temp dir writable"].startswith("no"), report
        for method in ("spawn", "fork"):
            assert report[method] == [0, 7], report
            assert report[f"{method} failing"] == "ProcessRaisedException (error_index 1)"
        # multiprocessing itself puts the fork server's socket in the temp dir:
        # forkserver cannot start there, and says why before any rank exists.
        assert report["forkserver"].startswith("OSError"), report
        assert read_only in report["forkserver"]
        assert os.listdir(read_only) == []
    finally:
        os.chmod(read_only, 0o700)
        shutil.rmtree(read_only)


# --- 6. security: where results come from, and what a rank holds -----------------------


def fd_table(pid: int) -> dict[int, str]:
    table = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
    return table


def pidfd_target(pid: int, fd: int) -> int:
    """The pid a pidfd held by ``pid`` refers to, from /proc/<pid>/fdinfo/<fd>."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise AssertionError(f"fd {fd} of pid {pid} is not a pidfd")


def inventory(pid: int, handshake: Connection) -> Counter[str]:
    """What the process ``pid`` holds, by role: one label per fd."""
    ours = set(fd_table(os.getpid()).values())
    handshake_pipe = os.readlink(f"/proc/self/fd/{handshake.fileno()}")
    labels: Counter[str] = Counter()
    for fd, target in fd_table(pid).items():
        if fd in (0, 1, 2):
            label = "stdio"
        elif target == handshake_pipe:
            label = "the test's handshake pipe"
        elif target == "anon_inode:[pidfd]":
            watched = pidfd_target(pid, fd)
            label = "pidfd of the supervisor" if watched == os.getpid() else f"pidfd of {watched}"
        elif target == "/dev/null":
            label = "/dev/null"
        elif target.startswith("pipe:"):
            label = (
                "pipe shared with the supervisor"
                if target in ours
                else "pipe (other end elsewhere)"
            )
        elif target.startswith("socket:"):
            # A rank holds one: its end of its channel's socket pair (the
            # supervisor's end is another inode, so it is counted, not matched).
            label = "a socket"
        else:
            label = target  # a file, an event poll: none is expected
        labels[label] += 1
    return labels


ALLOWED = {
    "stdio",
    "/dev/null",
    "the test's handshake pipe",
    "pidfd of the supervisor",
    "pipe shared with the supervisor",
    "pipe (other end elsewhere)",
    "a socket",
}


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_rank_holds_only_what_multiprocessing_needs_plus_its_pipes_and_pidfd(
    start_method: str,
) -> None:
    """Compare a running rank's fds with those of a plain multiprocessing child.

    Found on Linux 6.18 / CPython 3.11 (fds 0-2 inherited in both):

    * a plain ``spawn`` child holds a /dev/null (multiprocessing's replacement
      stdin), the resource tracker's pipe, the write end of its sentinel pipe
      and a dup of its bootstrap pipe (the "parent sentinel"), plus what its
      arguments carry (here the test's handshake pipe); a plain ``forkserver``
      child holds the same, a second /dev/null (the fork server's own stdin)
      and the fork server's "alive" pipe instead of the sentinel's write end;
    * an aiospawn rank holds exactly that, plus the write end of its result
      pipe (an anonymous pipe whose read end only the supervisor holds), its
      end of its channel (one socket of a pair) and a pidfd of the supervisor
      (the parent-death guard). No regular file, no other socket, no event
      poll, no pidfd of another process, no sibling's pipe.

    Under ``fork`` a rank starts with the supervisor's whole fd table, as any
    ``fork`` child does; the bootstrap closes aiospawn's part of it and the
    event loop's epoll and wakeup pipe, and leaves the program's own (see
    tests/test_rank_plumbing.py, which asserts what a rank of each start
    method holds of the supervisor's plumbing).
    """
    context = multiprocessing.get_context(start_method)
    reader, writer = context.Pipe(duplex=False)
    with reader, writer:
        inbox = Inbox(reader)
        plain = context.Process(target=ranks.rel_ready_sleep, args=(0, writer))
        plain.start()
        try:
            await inbox.wait_for("ready", 1)
            assert plain.pid is not None
            baseline = inventory(plain.pid, writer)
        finally:
            plain.terminate()
            await anyio.to_thread.run_sync(plain.join)
            plain.close()

        ctx = await aiospawn.start_processes(
            ranks.rel_ready_sleep, (writer,), 2, join=False, start_method=start_method
        )
        try:
            await inbox.wait_for("ready", 3)
            held = [inventory(pid, writer) for pid in ctx.pids()]
        finally:
            await ctx.terminate(grace_period=5)

    print(f"{start_method}: plain child {dict(baseline)}; ranks {[dict(h) for h in held]}")
    expected = baseline + Counter(
        {"pipe shared with the supervisor": 1, "pidfd of the supervisor": 1, "a socket": 1}
    )
    for rank, labels in enumerate(held):
        assert set(labels) <= ALLOWED, f"rank {rank} holds {labels}"
        assert labels == expected, f"rank {rank}: {labels}, plain child: {baseline}"


_AUDITED: list[tuple[str, tuple[Any, ...]]] | None = None
_AUDIT_HOOK_INSTALLED = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _AUDITED is not None and event in ("open", "socket.connect", "socket.bind"):
        _AUDITED.append((event, args))


def start_auditing() -> list[tuple[str, tuple[Any, ...]]]:
    """Record file opens and socket addresses in this process until stop_auditing()."""
    global _AUDITED, _AUDIT_HOOK_INSTALLED
    if not _AUDIT_HOOK_INSTALLED:  # audit hooks cannot be removed: install one, once
        sys.addaudithook(_audit)
        _AUDIT_HOOK_INSTALLED = True
    _AUDITED = []
    return _AUDITED


def stop_auditing() -> None:
    global _AUDITED
    _AUDITED = None


def inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_a_failing_run_reads_nothing_from_the_file_system(
    start_method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Results and exceptions come over the rank's pipe: no temp file, no path at all."""
    temp_dirs = sorted({tempfile.gettempdir(), multiprocessing.util.get_temp_dir()})
    # The one path involved: multiprocessing's fork server socket, in its own
    # temp dir, which only we can enter. It carries pids and exit codes, no pickle.
    mp_dir = os.stat(multiprocessing.util.get_temp_dir())
    assert (mp_dir.st_mode & 0o777, mp_dir.st_uid) == (0o700, os.getuid())
    before = {directory: sorted(os.listdir(directory)) for directory in temp_dirs}
    events = start_auditing()
    try:
        with pytest.raises(aiospawn.ProcessRaisedException) as info:
            await aiospawn.start_processes(ranks.raise_in, (1,), 2, start_method=start_method)
    finally:
        stop_auditing()
    assert info.value.error_index == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert {directory: sorted(os.listdir(directory)) for directory in temp_dirs} == before
    opened = [args[0] for event, args in events if event == "open" and isinstance(args[0], str)]
    for path in opened:
        assert not any(inside(path, directory) for directory in temp_dirs), path
    assert not [args for event, args in events if event == "socket.bind"]
    for _event, (_socket, address) in [item for item in events if item[0] == "socket.connect"]:
        assert start_method == "forkserver", f"a {start_method} start connected to {address}"
        assert inside(address, multiprocessing.util.get_temp_dir()), address
