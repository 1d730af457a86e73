"""Scenarios about supervising running ranks: failure detection (3), event-loop lag (4),
teardown (5), idle supervisor overhead (6)."""

from __future__ import annotations

import random
import time
from functools import partial
from typing import Any

import anyio
import workloads
from harness import (
    Measure,
    Peer,
    ScenarioResult,
    UsageSampler,
    alternate,
    cpu_seconds,
    import_torch_mp,
    ms,
    percentile,
    read_stamp,
    read_stamps,
    stamp_dir,
    start_plain,
    stop_plain,
    torch_ranks_fit,
    wait_stamps,
    wait_stamps_blocking,
)

import aiospawn

# --- 3. failure detection ------------------------------------------------------------------

#: The failing rank exits this long after its start, plus a random part of the poll
#: interval, so that the polling peer sees every phase of its period.
FAIL_DELAY = 0.2
POLL_INTERVAL = 0.1


def _fail_args(outdir: str) -> tuple[str, float]:
    return (outdir, FAIL_DELAY + random.uniform(0.0, POLL_INTERVAL))


async def _aiospawn_join_failure() -> Measure:
    with stamp_dir() as outdir:
        ctx = await aiospawn.start_processes(
            workloads.fail_after, _fail_args(outdir), nprocs=2, join=False, start_method="fork"
        )
        try:
            await ctx.join()
        except aiospawn.ProcessExitedException:
            raised = time.monotonic()
        else:
            raise AssertionError("join() returned although rank 1 failed")
        failed = read_stamp(outdir, workloads.FAIL_STAMP)
    return {"raised [ms]": ms(raised - failed)}


async def _aiospawn_group_failure() -> Measure:
    cancelled = None
    with stamp_dir() as outdir:
        try:
            async with aiospawn.open_group(
                workloads.fail_after, _fail_args(outdir), 2, start_method="fork"
            ):
                try:
                    await anyio.sleep(60)
                except anyio.get_cancelled_exc_class():
                    cancelled = time.monotonic()
                    raise
        except aiospawn.ProcessExitedException:
            raised = time.monotonic()
        else:
            raise AssertionError("open_group() did not raise although rank 1 failed")
        failed = read_stamp(outdir, workloads.FAIL_STAMP)
    assert cancelled is not None
    return {"detected [ms]": ms(cancelled - failed), "raised [ms]": ms(raised - failed)}


def _torch_join_failure(tmp: Any) -> Measure:
    with stamp_dir() as outdir:
        ctx = tmp.start_processes(
            workloads.fail_after, _fail_args(outdir), nprocs=2, join=False, start_method="fork"
        )
        try:
            while not ctx.join():
                pass
        except tmp.ProcessExitedException:
            raised = time.monotonic()
        else:
            raise AssertionError("torch join() returned although rank 1 failed")
        failed = read_stamp(outdir, workloads.FAIL_STAMP)
    return {"raised [ms]": ms(raised - failed)}


def _start_failing_pair(outdir: str) -> list[Any]:
    return start_plain("fork", workloads.fail_after, 2, *_fail_args(outdir))


def _stop_survivors(processes: list[Any]) -> None:
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    for process in processes:
        process.join()


def _floor_failure() -> Measure:
    with stamp_dir() as outdir:
        processes = _start_failing_pair(outdir)
        processes[1].join()  # knows which rank fails: the best any supervisor can do
        detected = time.monotonic()
        _stop_survivors(processes)
        raised = time.monotonic()
        failed = read_stamp(outdir, workloads.FAIL_STAMP)
    return {"detected [ms]": ms(detected - failed), "raised [ms]": ms(raised - failed)}


def _poll_failure() -> Measure:
    with stamp_dir() as outdir:
        processes = _start_failing_pair(outdir)
        while not any(process.exitcode not in (None, 0) for process in processes):
            time.sleep(POLL_INTERVAL)
        detected = time.monotonic()
        _stop_survivors(processes)
        raised = time.monotonic()
        failed = read_stamp(outdir, workloads.FAIL_STAMP)
    return {"detected [ms]": ms(detected - failed), "raised [ms]": ms(raised - failed)}


async def failure(result: ScenarioResult, quick: bool) -> None:
    """Scenario 3: from a rank's os._exit(1) to the supervisor noticing and raising."""
    trials = 4 if quick else 20
    result.note(
        f"2 ranks, fork. Rank 1 sleeps {FAIL_DELAY:g} s plus a random part of"
        f" {POLL_INTERVAL:g} s (every supervisor is waiting by then), takes"
        " `time.monotonic()`, writes it through an open fd and calls `os._exit(1)`; rank 0"
        " sleeps and dies at once on SIGTERM. Every figure is measured from that stamp, so it"
        " includes the kernel's work to end the process. 'detected' (no teardown): aiospawn"
        " open_group = the moment the block's body sees its cancellation (`except Cancelled`);"
        " polling = the poll that sees the exit code; floor = `Process.join()` of the rank"
        " known to fail. 'raised' (includes the teardown: SIGTERM to rank 0, its exit,"
        " reaping both): aiospawn = `await ctx.join()` / the `async with` raising"
        " ProcessExitedException; torch = `ctx.join()` raising, blocking the main thread;"
        " polling and floor = after `terminate()` and `join()` of the survivor. No grace"
        " period anywhere (`grace_period=None`): neither aiospawn nor torch waits before"
        " SIGTERM."
    )
    result.note(
        "Two cases: first a parent that has not imported torch (aiospawn's own setting),"
        " then, after `import torch`, the same peers plus torch. A process forked from a"
        " parent holding torch's mappings takes the kernel about 3-4 ms longer to end (measured"
        " here: 0.5 ms vs 3.7 ms from the stamp to the pidfd becoming readable), whoever"
        " supervises it; compare peers within a case."
    )
    result.note(
        f"polling: `Process.exitcode` of every rank checked every {POLL_INTERVAL:g} s, as"
        " torchrun's monitor does (`--monitor-interval 0.1`)."
    )

    def peers() -> list[Peer]:
        return [
            Peer("aiospawn join", _aiospawn_join_failure, trials, warmup=1),
            Peer("aiospawn open_group", _aiospawn_group_failure, trials, warmup=1),
            Peer("floor: join the failing rank", _floor_failure, trials),
            Peer("polling 0.1 s", _poll_failure, trials),
        ]

    await alternate(result, "fork, N=2, parent without torch", peers())
    tmp = import_torch_mp()
    with_torch = [*peers(), Peer("torch join", partial(_torch_join_failure, tmp), trials)]
    await alternate(result, "fork, N=2, parent imported torch", with_torch)


# --- 4. event-loop lag ---------------------------------------------------------------------

RUN_SECONDS = 2.0
TICK = 0.001


async def _ticker(lags: list[float]) -> None:
    while True:
        before = time.monotonic()
        await anyio.sleep(TICK)
        lags.append(time.monotonic() - before - TICK)


async def _with_ticker(body: Any) -> Measure:
    lags: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_ticker, lags)
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


async def _aiospawn_lag(method: str, nprocs: int) -> Measure:
    async def body() -> None:
        with stamp_dir() as outdir, anyio.CancelScope() as scope:
            async with aiospawn.open_group(
                workloads.sleep_forever, (outdir,), nprocs, start_method=method, grace_period=5
            ):
                await wait_stamps(outdir, nprocs)
                await anyio.sleep(RUN_SECONDS)
                scope.cancel()
                await anyio.sleep_forever()

    return await _with_ticker(body)


def _torch_blocking(tmp: Any, method: str, nprocs: int) -> None:
    with stamp_dir() as outdir:
        ctx = tmp.start_processes(
            workloads.sleep_forever, (outdir,), nprocs=nprocs, join=False, start_method=method
        )
        wait_stamps_blocking(outdir, nprocs)
        time.sleep(RUN_SECONDS)
        for process in ctx.processes:
            process.terminate()
        try:
            while not ctx.join():
                pass
        except tmp.ProcessExitedException:
            pass


async def _torch_lag(tmp: Any, method: str, nprocs: int) -> Measure:
    async def body() -> None:
        await anyio.to_thread.run_sync(_torch_blocking, tmp, method, nprocs)

    return await _with_ticker(body)


def _mp_blocking(method: str, nprocs: int) -> None:
    with stamp_dir() as outdir:
        processes = start_plain(method, workloads.sleep_forever, nprocs, outdir)
        wait_stamps_blocking(outdir, nprocs)
        time.sleep(RUN_SECONDS)
        stop_plain(processes)


async def _mp_lag(method: str, nprocs: int) -> Measure:
    async def body() -> None:
        await anyio.to_thread.run_sync(_mp_blocking, method, nprocs)

    return await _with_ticker(body)


async def _idle_lag() -> Measure:
    return await _with_ticker(partial(anyio.sleep, RUN_SECONDS))


async def lag(result: ScenarioResult, quick: bool) -> None:
    """Scenario 4: lag of a 1 ms ticker on the loop while ranks start, run and stop."""
    nprocs = 16 if quick else 64
    trials = 2 if quick else 3
    result.note(
        f"A task on the event loop sleeps {TICK * 1000:g} ms in a loop and records how late"
        " each wake-up is (actual minus expected). Window: from just before the start call to"
        f" the end of the teardown. The ranks start, all record their entry, run"
        f" {RUN_SECONDS:g} s more, then are torn down. aiospawn: `open_group` inside a"
        " cancel scope that is then cancelled. torch: the usual workaround,"
        " `start_processes(join=False)`, a sleep, `terminate()` of every process and"
        " `join()` in a worker thread through `anyio.to_thread.run_sync`. idle: the ticker"
        " alone for the same time (the loop's own timer resolution and the machine's noise)."
        " multiprocessing in thread: plain `Process` objects started, terminated and joined in"
        " a worker thread; it shows what the ranks' own start-up does to the loop (on 2 cores,"
        " N new interpreters starve the loop's thread of CPU) with no supervisor at all."
    )
    result.note(
        "Cases marked 'torch parent' run after `import torch` in the supervising process:"
        " `os.fork()` holds the GIL while the kernel copies the parent's page tables, which"
        " takes milliseconds once torch is mapped, so every fork start stalls the loop that"
        " long, whoever forks."
    )
    # Without torch in the parent: aiospawn's own setting.
    for index, method in enumerate(("fork", "spawn")):
        warmup = int(index == 0 and not quick)
        peers = [
            Peer("aiospawn", partial(_aiospawn_lag, method, nprocs), trials, warmup=warmup),
            Peer(
                "multiprocessing in thread",
                partial(_mp_lag, method, nprocs),
                1 if quick else trials,
            ),
        ]
        if index == 0 or not quick:
            peers.append(Peer("idle loop", _idle_lag, 1 if quick else 2))
        await alternate(result, f"{method}, N={nprocs}", peers)
    tmp = import_torch_mp()
    torch_cases = [("fork", nprocs)]
    if not quick:
        # 64 ranks importing torch at once need about 18 GB: torch's spawn row has 16.
        torch_cases.append(("spawn", 16))
        result.note(
            "torch under spawn runs 16 ranks, not 64: 64 ranks importing torch at once need"
            " about 18 GB of memory. --quick has no torch spawn row (16 ranks importing torch"
            " take about 20 s here)."
        )
    for method, count in torch_cases:
        peers = [Peer("aiospawn", partial(_aiospawn_lag, method, count), 1 if quick else trials)]
        if method == "fork" or torch_ranks_fit(count):
            torch_trials = 1 if quick or method == "spawn" else trials
            peers.append(
                Peer("torch in thread", partial(_torch_lag, tmp, method, count), torch_trials)
            )
        if not quick:
            peers.append(Peer("idle loop", _idle_lag, 2))
        await alternate(result, f"{method}, N={count}, torch parent", peers)


# --- 5. teardown ---------------------------------------------------------------------------

TEARDOWN_RANKS = 64


async def _aiospawn_teardown(nprocs: int, ignore_rank: int, grace: float) -> Measure:
    with stamp_dir() as outdir:
        with anyio.CancelScope() as scope:
            async with aiospawn.open_group(
                workloads.sleep_forever,
                (outdir, ignore_rank),
                nprocs,
                start_method="fork",
                grace_period=grace,
            ):
                await wait_stamps(outdir, nprocs)
                cancelled = time.monotonic()
                scope.cancel()
                await anyio.sleep_forever()
        reaped = time.monotonic()
    return {"teardown [ms]": ms(reaped - cancelled)}


def _loop_teardown(nprocs: int, ignore_rank: int, grace: float) -> Measure:
    with stamp_dir() as outdir:
        processes = start_plain("fork", workloads.sleep_forever, nprocs, outdir, ignore_rank)
        wait_stamps_blocking(outdir, nprocs)
        cancelled = time.monotonic()
        # torch's ProcessContext.join() escalation, as written in torch/multiprocessing/spawn.py
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + grace
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
        reaped = time.monotonic()
    return {"teardown [ms]": ms(reaped - cancelled)}


async def teardown(result: ScenarioResult, quick: bool) -> None:
    """Scenario 5: from cancellation to every rank reaped."""
    trials = 3 if quick else 10
    result.note(
        f"{TEARDOWN_RANKS} ranks, fork, each sleeping until signalled; timed once every rank"
        " has recorded its entry. aiospawn: from `cancel()` of the scope around `open_group`"
        " to the scope's exit (every rank reaped; SIGTERM, grace, SIGKILL). torch-style loop:"
        " the escalation `torch.multiprocessing`'s `join()` runs after a failure, on plain"
        " processes: `terminate()` all, `join()` all within one grace deadline, `kill()` the"
        " survivors, `join()` them (torch has no teardown call of its own)."
    )
    cases = [
        ("all honour SIGTERM", -1, 5.0, trials),
        ("rank 0 ignores SIGTERM, grace 0.5 s", 0, 0.5, 2 if quick else 5),
    ]
    for label, ignore_rank, grace, count in cases:
        peers = [
            Peer(
                "aiospawn",
                partial(_aiospawn_teardown, TEARDOWN_RANKS, ignore_rank, grace),
                count,
                warmup=1 if ignore_rank < 0 else 0,
            ),
            Peer(
                "torch-style loop",
                partial(_loop_teardown, TEARDOWN_RANKS, ignore_rank, grace),
                count,
            ),
        ]
        await alternate(result, f"fork, N={TEARDOWN_RANKS}, {label}", peers)


# --- 6. idle supervisor overhead -----------------------------------------------------------

IDLE_RANKS = 16

#: The idle window starts this long after every rank has recorded its entry and ends
#: this long before the first rank's sleep is over.
IDLE_MARGIN = 0.25


def _arm_sampler(outdir: str, seconds: float) -> UsageSampler:
    """A sampler armed for the time every rank sleeps."""
    sampler = UsageSampler()
    first_exit = min(read_stamps(outdir, IDLE_RANKS)) + seconds
    sampler.arm(time.monotonic() + IDLE_MARGIN, first_exit - IDLE_MARGIN)
    return sampler


def _usage_measure(sampler: UsageSampler, wait_cpu: float) -> Measure:
    wall, cpu, switches = sampler.result()
    return {
        "CPU while asleep [% of a core]": 100.0 * cpu / wall,
        "context switches while asleep [per s]": switches / wall,
        "CPU until all reaped [ms]": ms(wait_cpu),
    }


async def _aiospawn_idle(seconds: float) -> Measure:
    with stamp_dir() as outdir:
        ctx = await aiospawn.start_processes(
            workloads.sleep_then_return,
            (outdir, seconds),
            nprocs=IDLE_RANKS,
            join=False,
            start_method="fork",
        )
        await wait_stamps(outdir, IDLE_RANKS)
        sampler = _arm_sampler(outdir, seconds)
        cpu = cpu_seconds()
        await ctx.join()
        return _usage_measure(sampler, cpu_seconds() - cpu)


def _torch_idle(tmp: Any, seconds: float) -> Measure:
    with stamp_dir() as outdir:
        ctx = tmp.start_processes(
            workloads.sleep_then_return,
            (outdir, seconds),
            nprocs=IDLE_RANKS,
            join=False,
            start_method="fork",
        )
        wait_stamps_blocking(outdir, IDLE_RANKS)
        sampler = _arm_sampler(outdir, seconds)
        cpu = cpu_seconds()
        while not ctx.join():
            pass
        return _usage_measure(sampler, cpu_seconds() - cpu)


def _poll_idle(seconds: float) -> Measure:
    with stamp_dir() as outdir:
        processes = start_plain("fork", workloads.sleep_then_return, IDLE_RANKS, outdir, seconds)
        wait_stamps_blocking(outdir, IDLE_RANKS)
        sampler = _arm_sampler(outdir, seconds)
        cpu = cpu_seconds()
        while any(process.exitcode is None for process in processes):
            time.sleep(POLL_INTERVAL)
        for process in processes:
            process.join()
        return _usage_measure(sampler, cpu_seconds() - cpu)


async def idle(result: ScenarioResult, quick: bool) -> None:
    """Scenario 6: what supervising sleeping ranks costs the parent."""
    tmp = import_torch_mp()
    seconds = 3.0 if quick else 10.0
    trials = 1 if quick else 3
    result.note(
        f"{IDLE_RANKS} ranks, fork, each sleeping {seconds:g} s then returning. 'while asleep':"
        f" from {IDLE_MARGIN:g} s after every rank has recorded its entry until"
        f" {IDLE_MARGIN:g} s before the first one wakes, a sampler thread reads the parent's"
        " CPU time (getrusage RUSAGE_SELF: user + system, every thread) and context switches"
        " (voluntary + involuntary, every thread: each is a wake-up or a preemption); the"
        " sampler's own two wake-ups are included. 'until all reaped': CPU from the start of"
        " the wait until it returns, so it adds reaping the ranks and collecting their"
        " results. aiospawn:"
        " `await ctx.join()` on the event loop; torch: `while not ctx.join(): pass` (blocks in"
        " `multiprocessing.connection.wait`); polling: `Process.exitcode` of every rank every"
        f" {POLL_INTERVAL:g} s."
    )
    peers = [
        Peer("aiospawn", partial(_aiospawn_idle, seconds), trials),
        Peer("torch", partial(_torch_idle, tmp, seconds), trials),
        Peer("polling 0.1 s", partial(_poll_idle, seconds), trials),
    ]
    await alternate(result, f"fork, N={IDLE_RANKS}, {seconds:g} s asleep", peers)
