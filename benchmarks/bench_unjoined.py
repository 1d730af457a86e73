"""Scenario ``unjoined``: a ``join=False`` group that nobody joins, against a supervised block.

Issue 25 asks that a group started with ``start_processes(join=False)`` and
never joined be driven all the same: its channel round trip costs what it
costs in an ``async with open_group(...)`` block, and a rank's exit is reaped
within 100 ms. Two cases, public API only (the same code measures any
checkout of the library, see ``compare.py``):

* round trip: 64 B to one fork rank and back, in alternation over a block's
  channel, over the channel of a ``join=False`` group that nobody joins (the
  task only sends and receives), and over a socket pair driven on the event
  loop (``bench_live.LoopSocket``, the floor of any event-loop transport);
* reaping: rank 1 of two fork ranks exits (``os._exit(0)``) when told; a
  thread watches ``/proc/<pid>`` and records when it disappears (the zombie
  reaped), measured from the rank's ``time.monotonic()`` stamp just before
  its exit. Meanwhile the event loop only waits for that thread.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import anyio
import anyio.to_thread
import workloads
from bench_live import LoopSocket, channel_rank, channel_round_trips, latency
from harness import (
    Measure,
    Peer,
    ScenarioResult,
    alternate,
    ms,
    read_stamp,
    stamp_dir,
    wait_stamps,
)

import aiospawn

SMALL = 64

#: Seconds a trial waits for the exited rank to be reaped before it records this cap.
REAP_CAP = 1.0

#: How often the watching thread looks at ``/proc/<pid>``; the figures' resolution.
REAP_POLL = 0.0002

BLOCK = "open_group block"
UNJOINED = "join=False, nobody joins"
FLOOR = "raw socket on the loop"


def _watch_reap(pid: int, go: Any) -> float | None:
    """Tell the rank to exit, then the ``time.monotonic()`` at which ``pid`` is gone.

    A process stays in ``/proc`` until its parent reaps it (a zombie has an
    entry too), so the entry's disappearance is the reap, seen within
    ``REAP_POLL``. None if it is still there after ``REAP_CAP`` seconds.
    """
    path = f"/proc/{pid}"
    go.send(None)
    deadline = time.monotonic() + REAP_CAP
    while time.monotonic() < deadline:
        try:
            os.stat(path)
        except FileNotFoundError:
            return time.monotonic()
        time.sleep(REAP_POLL)
    return None


async def _reap_trial(ctx: Any, outdir: str, go: Any) -> Measure:
    await wait_stamps(outdir, 2)
    pid = ctx.pids()[1]
    reaped = await anyio.to_thread.run_sync(_watch_reap, pid, go)
    exited = read_stamp(outdir, workloads.EXIT_STAMP)
    return {"exit to reaped [ms]": ms(reaped - exited) if reaped is not None else ms(REAP_CAP)}


async def _reap_unjoined() -> Measure:
    with stamp_dir() as outdir:
        go_rank, go = multiprocessing.Pipe(duplex=False)
        ctx = await aiospawn.start_processes(
            workloads.exit_when_told, (outdir, go_rank), nprocs=2, join=False, start_method="fork"
        )
        try:
            return await _reap_trial(ctx, outdir, go)
        finally:
            await ctx.terminate(grace_period=5)
            go_rank.close()
            go.close()


async def _reap_block() -> Measure:
    with stamp_dir() as outdir:
        go_rank, go = multiprocessing.Pipe(duplex=False)
        try:
            async with aiospawn.open_group(
                workloads.exit_when_told, (outdir, go_rank), 2, start_method="fork"
            ) as ctx:
                measure = await _reap_trial(ctx, outdir, go)
                await ctx.terminate(grace_period=5)
        except aiospawn.ProcessExitedException:
            pass  # rank 0, stopped by our terminate(): the block reports it
        finally:
            go_rank.close()
            go.close()
    return measure


async def unjoined(
    result: ScenarioResult, quick: bool, trials: int = 7, reap_trials: int = 20
) -> None:
    """A ``join=False`` group nobody joins: 64 B round trips and the reaping of an exit.

    ``trials`` and ``reap_trials`` are the full run's; ``--quick`` runs 3 and 5.
    """
    if quick:
        trials, reap_trials = 3, 5
    count = 500 if quick else 2000
    loop_socket = LoopSocket()
    try:
        async with aiospawn.open_group(
            channel_rank, nprocs=1, start_method="fork", wait_ready=True
        ) as group:
            unjoined_ctx = await aiospawn.start_processes(
                channel_rank, nprocs=1, join=False, start_method="fork"
            )
            try:
                await unjoined_ctx.wait_ready()
                block_channel = group.channel(0)
                unjoined_channel = unjoined_ctx.channel(0)
                payload = bytes(SMALL)

                async def in_block() -> Measure:
                    return latency(await channel_round_trips(block_channel, payload, count))

                async def in_unjoined() -> Measure:
                    return latency(await channel_round_trips(unjoined_channel, payload, count))

                async def on_loop() -> Measure:
                    return latency(await channel_round_trips(loop_socket, payload, count))

                await alternate(
                    result,
                    f"round trip, 64 B, {count} per trial",
                    [
                        Peer(BLOCK, in_block, trials, warmup=1),
                        Peer(UNJOINED, in_unjoined, trials, warmup=1),
                        Peer(FLOOR, on_loop, trials, warmup=1),
                    ],
                )
            finally:
                await unjoined_ctx.terminate(grace_period=5)
            # The rank's channel_rank() returns on EOF once the block closes its channel.
    finally:
        await loop_socket.aclose()
    await alternate(
        result,
        "reaping an exit, fork, N=2",
        [
            Peer(UNJOINED, _reap_unjoined, reap_trials, warmup=1),
            Peer(BLOCK, _reap_block, reap_trials, warmup=1),
        ],
    )
    _ratio_notes(result)
    result.note(
        "Round trip: one fork rank per peer answering in a blocking `aiospawn.channel()` loop"
        " (`bench_live.channel_rank`), started once; send 64 B, receive the echo, timed per"
        " round trip with `time.perf_counter()`; p50 and p99 within a trial, the table's"
        " median and p95 across trials. open_group block: the channel of an"
        " `async with aiospawn.open_group(...)` block's rank. join=False, nobody joins: the"
        " channel of a group from `start_processes(join=False)` after `wait_ready()`, which"
        " nothing joins or waits on while the round trips run. raw socket on the loop: a"
        " socket pair written and read on the event loop (the floor)."
    )
    result.note(
        "Reaping: two fork ranks; rank 1 blocks on a pipe, and when told writes"
        " `time.monotonic()` through an open fd and calls `os._exit(0)` (a success: the group"
        " goes on). A thread tells it, then stats `/proc/<pid>` every"
        f" {REAP_POLL * 1e3:g} ms until the entry is gone (the zombie reaped); the figure is"
        " that moment minus the stamp, so it includes the kernel's work to end the process."
        f" A rank still unreaped after {REAP_CAP:g} s counts as {ms(REAP_CAP):g} ms."
        " Meanwhile the event loop only awaits that thread; nobody calls `join()`."
    )


def _ratio_notes(result: ScenarioResult) -> None:
    """The ratios the issue asks about, and how many exits were reaped within 100 ms."""
    medians = {(s.case, s.metric, s.peer): s for s in result.series}
    for (case, metric, peer), series in medians.items():
        if peer != UNJOINED:
            continue
        if metric == "p50 [µs]":
            block = medians[(case, metric, BLOCK)].median
            floor = medians[(case, metric, FLOOR)].median
            result.note(
                f"64 B p50: join=False unjoined {series.median:.0f} µs, block {block:.0f} µs,"
                f" floor {floor:.0f} µs; unjoined / block = {series.median / block:.2f}x,"
                f" block / floor = {block / floor:.2f}x."
            )
        if metric == "exit to reaped [ms]":
            within = sum(value <= 100.0 for value in series.samples)
            result.note(
                f"join=False unjoined: {within} of {len(series.samples)} exits reaped within"
                f" 100 ms; median {series.median:.1f} ms, max {max(series.samples):.1f} ms."
            )
