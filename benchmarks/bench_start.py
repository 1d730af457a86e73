"""Scenarios about starting ranks: start-up (1), large-argument start (2), scale (7).

A rank is running once it has recorded ``time.monotonic()`` at the entry of
its ``fn`` (see ``workloads``); "all running" is the latest such stamp minus
the parent's ``time.monotonic()`` just before the call.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import psutil
import workloads
from harness import (
    Measure,
    Peer,
    ScenarioResult,
    alternate,
    environ,
    import_torch_mp,
    ms,
    progress,
    read_stamps,
    stamp_dir,
    start_plain,
    stop_plain,
    torch_ranks_fit,
    wait_stamps,
    wait_stamps_blocking,
)

import aiospawn

START_METHODS = ("spawn", "forkserver", "fork")

HERE = os.path.dirname(os.path.abspath(__file__))

TORCH_NOTE = (
    "torch rows are torch as it is: its rank entry point (`_wrap`) lives in"
    " `torch.multiprocessing.spawn`, so every `spawn` or `forkserver` rank imports torch"
    " (about 1.0-1.4 s of CPU each, measured here) before it runs `fn`; on 2 cores N ranks"
    " then need about N x 0.65 s. `fork` ranks inherit the parent's torch and pay nothing."
    " Every peer forks the same parent, which has imported torch."
)


def _warm_forkserver() -> None:
    """Start the forkserver (a one-time cost of the process) outside every timing."""
    context = multiprocessing.get_context("forkserver")
    with stamp_dir() as outdir:
        process = context.Process(target=workloads.record_entry, args=(0, outdir))
        process.start()
        process.join()


# --- 1. start-up ---------------------------------------------------------------------------


async def _aiospawn_startup(method: str, nprocs: int) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        await aiospawn.start_processes(
            workloads.record_entry, (outdir,), nprocs=nprocs, start_method=method
        )
        joined = time.monotonic()
        stamps = read_stamps(outdir, nprocs)
    return {"all running [ms]": ms(max(stamps) - started), "joined [ms]": ms(joined - started)}


def _torch_startup(tmp: Any, method: str, nprocs: int) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        tmp.start_processes(workloads.record_entry, (outdir,), nprocs=nprocs, start_method=method)
        joined = time.monotonic()
        stamps = read_stamps(outdir, nprocs)
    return {"all running [ms]": ms(max(stamps) - started), "joined [ms]": ms(joined - started)}


def _mp_startup(method: str, nprocs: int) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        processes = start_plain(method, workloads.record_entry, nprocs, outdir)
        for process in processes:
            process.join()
        joined = time.monotonic()
        assert all(process.exitcode == 0 for process in processes)
        stamps = read_stamps(outdir, nprocs)
    return {"all running [ms]": ms(max(stamps) - started), "joined [ms]": ms(joined - started)}


def _torch_startup_trials(method: str, nprocs: int, quick: bool) -> int:
    if method == "fork":
        return 3 if quick else 10
    if quick:
        return 1
    return {1: 5, 8: 3}.get(nprocs, 2)


async def startup(result: ScenarioResult, quick: bool) -> None:
    """Scenario 1: N trivial ranks, from the call to all running and to join complete."""
    tmp = import_torch_mp()
    _warm_forkserver()
    sizes = (1, 8) if quick else (1, 8, 32)
    trials = 3 if quick else 10
    result.note(
        "aiospawn: `await aiospawn.start_processes(fn, nprocs=N, start_method=m)` inside"
        " `anyio.run` (one event loop for the whole scenario, so its worker threads are warm,"
        " as in a running service). torch: `torch.multiprocessing.start_processes(...,"
        " join=True)`. multiprocessing (the floor): N `Process` objects made, started one"
        " after the other, then joined; no result pipe, no supervision. The clock starts just"
        " before the call; 'all running' ends at the last rank's stamp taken at the entry of"
        " fn, 'joined' when the call (or the last join) returns."
    )
    result.note(TORCH_NOTE)
    for method in START_METHODS:
        for nprocs in sizes:
            peers = [
                Peer(
                    "aiospawn",
                    partial(_aiospawn_startup, method, nprocs),
                    trials,
                    warmup=1 if nprocs == sizes[0] else 0,
                ),
                Peer(
                    "multiprocessing",
                    partial(_mp_startup, method, nprocs),
                    trials,
                    warmup=1 if nprocs == sizes[0] else 0,
                ),
            ]
            if method == "fork" or torch_ranks_fit(nprocs):
                torch_trials = _torch_startup_trials(method, nprocs, quick)
                peers.insert(
                    1, Peer("torch", partial(_torch_startup, tmp, method, nprocs), torch_trials)
                )
            else:
                result.note(f"torch skipped for {method}, N={nprocs}: not enough free memory.")
            await alternate(result, f"{method}, N={nprocs}", peers)


# --- 2. large argument ---------------------------------------------------------------------

LARGE_ARG_RANKS = 4
PAYLOAD_BYTES = 1 << 20


async def _aiospawn_large(fn: Any, payload: bytes) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        ctx = await aiospawn.start_processes(
            fn, (outdir, payload), nprocs=LARGE_ARG_RANKS, join=False, start_method="forkserver"
        )
        returned = time.monotonic()
        await ctx.join()
        joined = time.monotonic()
        stamps = read_stamps(outdir, LARGE_ARG_RANKS)
    return {
        "all running [ms]": ms(max(stamps) - started),
        "start returned [ms]": ms(returned - started),
        "joined [ms]": ms(joined - started),
    }


def _torch_large(tmp: Any, fn: Any, payload: bytes, parallel: bool) -> Measure:
    with stamp_dir() as outdir, environ(tmp.ENV_VAR_PARALLEL_START, "1" if parallel else None):
        started = time.monotonic()
        ctx = tmp.start_processes(
            fn, (outdir, payload), nprocs=LARGE_ARG_RANKS, join=False, start_method="forkserver"
        )
        returned = time.monotonic()
        while not ctx.join():
            pass
        joined = time.monotonic()
        stamps = read_stamps(outdir, LARGE_ARG_RANKS)
    return {
        "all running [ms]": ms(max(stamps) - started),
        "start returned [ms]": ms(returned - started),
        "joined [ms]": ms(joined - started),
    }


async def large_arg(result: ScenarioResult, quick: bool) -> None:
    """Scenario 2: torch issue 133010's case: forkserver, 4 ranks, 1 MB argument, 1 s import."""
    tmp = import_torch_mp()
    import slow_import  # 1 s, once, outside the timings (the parent pickles fn by name)

    _warm_forkserver()
    fn = slow_import.record_entry_with_payload
    payload = b"\x01" * PAYLOAD_BYTES
    result.note(
        f"{LARGE_ARG_RANKS} ranks, forkserver, a {PAYLOAD_BYTES >> 20} MB bytes argument,"
        f" fn in a module whose import sleeps {slow_import.IMPORT_SECONDS:g} s. Each rank"
        " imports that module while it unpickles fn, before it reads the rest of its"
        " arguments, so a start whose arguments exceed the 64 KiB pipe buffer waits for it."
        " 'all running' = last rank's stamp at fn entry minus the time before the call;"
        " 'start returned' = when `start_processes(join=False)` returned."
    )
    result.note(
        "torch sequential: TORCH_MP_PARALLEL_START unset; torch parallel:"
        " TORCH_MP_PARALLEL_START=1 set in os.environ around the call. torch ranks also"
        " import torch (see scenario 1)."
    )
    peers = [
        Peer("aiospawn", partial(_aiospawn_large, fn, payload), 2 if quick else 5, warmup=0),
        Peer("torch sequential", partial(_torch_large, tmp, fn, payload, False), 1 if quick else 3),
        Peer("torch parallel", partial(_torch_large, tmp, fn, payload, True), 1 if quick else 3),
    ]
    await alternate(result, f"forkserver, N={LARGE_ARG_RANKS}, 1 MB arg", peers)


# --- 7. scale ------------------------------------------------------------------------------


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


async def _aiospawn_scale(nprocs: int) -> Measure:
    with stamp_dir() as outdir:
        with anyio.CancelScope() as scope:
            started = time.monotonic()
            async with aiospawn.open_group(
                workloads.sleep_forever, (outdir,), nprocs, start_method="fork", grace_period=10
            ):
                returned = time.monotonic()
                await wait_stamps(outdir, nprocs)
                stamps = read_stamps(outdir, nprocs)
                cancelled = time.monotonic()
                scope.cancel()
                await anyio.sleep_forever()
        reaped = time.monotonic()
    return {
        "start returned [ms]": ms(returned - started),
        "all running [ms]": ms(max(stamps) - started),
        "teardown [ms]": ms(reaped - cancelled),
    }


def _mp_scale(nprocs: int) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        processes = start_plain("fork", workloads.sleep_forever, nprocs, outdir)
        returned = time.monotonic()
        wait_stamps_blocking(outdir, nprocs)
        stamps = read_stamps(outdir, nprocs)
        cancelled = time.monotonic()
        stop_plain(processes)
        reaped = time.monotonic()
    return {
        "start returned [ms]": ms(returned - started),
        "all running [ms]": ms(max(stamps) - started),
        "teardown [ms]": ms(reaped - cancelled),
    }


def _torch_scale(tmp: Any, nprocs: int) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        ctx = tmp.start_processes(
            workloads.sleep_forever, (outdir,), nprocs=nprocs, join=False, start_method="fork"
        )
        returned = time.monotonic()
        wait_stamps_blocking(outdir, nprocs)
        stamps = read_stamps(outdir, nprocs)
        cancelled = time.monotonic()
        stop_plain(ctx.processes)
        reaped = time.monotonic()
    return {
        "start returned [ms]": ms(returned - started),
        "all running [ms]": ms(max(stamps) - started),
        "teardown [ms]": ms(reaped - cancelled),
    }


def probe_memory() -> None:
    """In a fresh interpreter: the parent's RSS growth per rank for one peer (argv: peer, N).

    A fresh interpreter per run, because an interpreter that has run a group
    before reuses the memory it freed, and the growth then reads as zero.
    """
    import json
    import sys

    peer, nprocs = sys.argv[1], int(sys.argv[2])
    with stamp_dir() as outdir:
        if peer == "aiospawn":
            import aiospawn._api  # everything the call needs, loaded before the baseline

            async def measure() -> int:
                await anyio.lowlevel.checkpoint()
                before = _rss()
                ctx = await aiospawn.start_processes(
                    workloads.sleep_forever, (outdir,), nprocs, join=False, start_method="fork"
                )
                grown = _rss() - before
                await ctx.terminate(grace_period=10)
                return grown

            grown = anyio.run(measure)
        elif peer == "torch":
            tmp = import_torch_mp()
            before = _rss()
            ctx = tmp.start_processes(
                workloads.sleep_forever, (outdir,), nprocs=nprocs, join=False, start_method="fork"
            )
            grown = _rss() - before
            stop_plain(ctx.processes)
        else:
            before = _rss()
            processes = start_plain("fork", workloads.sleep_forever, nprocs, outdir)
            grown = _rss() - before
            stop_plain(processes)
    print(json.dumps({"parent RSS per rank [KiB]": grown / nprocs / 1024}))


async def _probe(peer: str, nprocs: int) -> Measure:
    import json
    import sys

    code = f"import sys; sys.path.insert(0, {HERE!r}); import bench_start as b; b.probe_memory()"
    done = await anyio.run_process([sys.executable, "-c", code, peer, str(nprocs)])
    measure: Measure = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return measure


async def scale(result: ScenarioResult, quick: bool) -> None:
    """Scenario 7: many fork ranks: start, teardown, parent memory per rank."""
    tmp = import_torch_mp()
    nprocs = 64 if quick else 256
    trials = 2 if quick else 3
    result.note(
        f"{nprocs} ranks, fork, each sleeping until signalled. 'start returned': until the"
        " start call returns (aiospawn: `open_group` entered); 'all running': last fn-entry"
        " stamp; 'teardown': aiospawn from `cancel()` of the scope around `open_group` until"
        " the scope exits (every rank reaped); torch and multiprocessing have no teardown call,"
        " so they get what torch's own escalation does: `terminate()` every process, then"
        " `join()` each."
    )
    result.note(
        "RSS per rank: in a fresh interpreter per run (an interpreter that ran a group before"
        " reuses the memory it freed), the parent's resident-set growth from just before the"
        " start call to its return (`start_processes(join=False)`), after gc.collect(),"
        " divided by N. It holds the process objects, pipes, watchers and, for aiospawn, the"
        " worker thread that forks."
    )
    peers = [
        Peer("aiospawn", partial(_aiospawn_scale, nprocs), trials, warmup=1),
        Peer("torch", partial(_torch_scale, tmp, nprocs), trials, warmup=1),
        Peer("multiprocessing", partial(_mp_scale, nprocs), trials, warmup=1),
    ]
    progress(f"[scale] {nprocs} ranks; pid {os.getpid()}")
    await alternate(result, f"fork, N={nprocs}", peers)
    memory_peers = [
        Peer(name, partial(_probe, name, nprocs), 1 if quick else trials)
        for name in ("aiospawn", "torch", "multiprocessing")
    ]
    await alternate(result, f"fork, N={nprocs}", memory_peers)
