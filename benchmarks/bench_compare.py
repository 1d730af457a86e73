"""Compact scenarios for ``compare.py``: aiospawn and its floors, without torch.

``compare.py`` measures two checkouts of the library against each other in
alternation, round after round; the full scenarios, with their torch peers
(minutes of torch imports), would not fit many rounds. These run the same
peer functions as ``startup``, ``failure``, ``teardown``, ``lag``, ``live``
and ``unjoined`` (imported from their modules, so a figure here is measured
as there), on fewer cases, each beside the floor that does not depend on
aiospawn (plain ``multiprocessing``, the torch-style loop, the idle loop, a
raw socket): a floor that moves between the two checkouts shows a load that
did. Their trial counts are per round: ``compare.py`` pools the rounds.
"""

from __future__ import annotations

from functools import partial

from bench_live import LoopSocket, channel_rank, channel_round_trips, collective_calls, latency
from bench_live import serving_rank as live_serving_rank
from bench_start import _aiospawn_startup, _mp_startup, _warm_forkserver
from bench_supervise import (
    TEARDOWN_RANKS,
    _aiospawn_group_failure,
    _aiospawn_join_failure,
    _aiospawn_lag,
    _aiospawn_teardown,
    _floor_failure,
    _idle_lag,
    _loop_teardown,
    _mp_lag,
)
from bench_unjoined import unjoined as unjoined_scenario
from harness import Measure, Peer, ScenarioResult, alternate

import aiospawn


async def startup(result: ScenarioResult, quick: bool) -> None:
    """``startup`` without torch: aiospawn against N plain processes, per start method."""
    _warm_forkserver()
    trials = 2 if quick else 3
    sizes = (1, 8)
    for method in ("spawn", "forkserver", "fork"):
        for nprocs in sizes:
            warmup = 1 if nprocs == sizes[0] else 0
            await alternate(
                result,
                f"{method}, N={nprocs}",
                [
                    Peer("aiospawn", partial(_aiospawn_startup, method, nprocs), trials, warmup),
                    Peer("multiprocessing", partial(_mp_startup, method, nprocs), trials, warmup),
                ],
            )
    result.note("As `startup` (`bench_start.py`), without torch: N = 1, 8.")


async def failure(result: ScenarioResult, quick: bool) -> None:
    """``failure`` in a parent without torch: from a rank's exit to join / the block raising."""
    trials = 2 if quick else 6
    await alternate(
        result,
        "fork, N=2",
        [
            Peer("aiospawn join", _aiospawn_join_failure, trials, warmup=1),
            Peer("aiospawn open_group", _aiospawn_group_failure, trials, warmup=1),
            Peer("floor: join the failing rank", _floor_failure, trials),
        ],
    )
    result.note("As `failure` (`bench_supervise.py`), the case of a parent without torch.")


async def teardown(result: ScenarioResult, quick: bool) -> None:
    """``teardown``: from cancelling the block to every rank reaped, 64 fork ranks."""
    cases = [
        ("all honour SIGTERM", -1, 5.0, 2 if quick else 3),
        ("rank 0 ignores SIGTERM, grace 0.5 s", 0, 0.5, 1),
    ]
    for label, ignore_rank, grace, trials in cases:
        await alternate(
            result,
            f"fork, N={TEARDOWN_RANKS}, {label}",
            [
                Peer(
                    "aiospawn",
                    partial(_aiospawn_teardown, TEARDOWN_RANKS, ignore_rank, grace),
                    trials,
                    warmup=1 if ignore_rank < 0 else 0,
                ),
                Peer(
                    "torch-style loop",
                    partial(_loop_teardown, TEARDOWN_RANKS, ignore_rank, grace),
                    trials,
                ),
            ],
        )
    result.note("As `teardown` (`bench_supervise.py`).")


async def lag(result: ScenarioResult, quick: bool) -> None:
    """``lag`` without torch: a 1 ms ticker while N ranks start, run 2 s and are torn down."""
    trials = 1
    # spawn N=32: the case issue 25 quotes (the loop's worst gap while 32 spawn ranks start).
    cases = (("fork", 16), ("spawn", 8)) if quick else (("fork", 64), ("spawn", 32))
    for index, (method, nprocs) in enumerate(cases):
        peers = [
            Peer("aiospawn", partial(_aiospawn_lag, method, nprocs), trials),
            Peer("multiprocessing in thread", partial(_mp_lag, method, nprocs), trials),
        ]
        if index == 0:
            peers.append(Peer("idle loop", _idle_lag, 1))
        await alternate(result, f"{method}, N={nprocs}", peers)
    result.note("As `lag` (`bench_supervise.py`), without torch; spawn with 32 ranks, not 64.")


async def live(result: ScenarioResult, quick: bool) -> None:
    """``live``'s round trips and collective call: a block's channel against a raw socket."""
    trials = 2
    small_count, large_count = (500, 50) if quick else (2000, 100)
    calls = 300 if quick else 500
    loop_socket = LoopSocket()
    try:
        async with aiospawn.open_group(
            channel_rank, nprocs=1, start_method="fork", wait_ready=True
        ) as group:
            channel = group.channel(0)
            for size, count, label in ((64, small_count, "64 B"), (1 << 20, large_count, "1 MB")):
                payload = bytes(size)

                async def ours(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(await channel_round_trips(channel, payload, count))

                async def on_loop(payload: bytes = payload, count: int = count) -> Measure:
                    return latency(await channel_round_trips(loop_socket, payload, count))

                await alternate(
                    result,
                    f"round trip, {label}, {count} per trial",
                    [
                        Peer("aiospawn", ours, trials, warmup=1),
                        Peer("raw socket on the loop", on_loop, trials, warmup=1),
                    ],
                )
    finally:
        await loop_socket.aclose()
    async with aiospawn.open_group(
        live_serving_rank, nprocs=8, start_method="fork", wait_ready=True
    ) as callers:

        async def call_all() -> Measure:
            return latency(await collective_calls(callers, calls, None))

        async def call_one() -> Measure:
            return latency(await collective_calls(callers, calls, [0]))

        await alternate(
            result,
            f"collective call, {calls} per trial",
            [
                Peer("aiospawn, 8 ranks", call_all, trials, warmup=1),
                Peer("aiospawn, 1 rank", call_one, trials, warmup=1),
            ],
        )
    result.note("As `live` (`bench_live.py`): round trips and collective calls, in a block.")


async def unjoined(result: ScenarioResult, quick: bool) -> None:
    """``unjoined`` with a round's share of its trials: 4 of round trips, 10 reaps."""
    await unjoined_scenario(result, quick, trials=4, reap_trials=10)
