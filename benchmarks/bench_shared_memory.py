"""100 MB numpy arrays and torch tensors to 1 and to 8 ranks: through a memfd, against the floor.

A focused run of ``bench_dataplane``'s 100 MB cases with the peers that
matter to issue 26's "no copies for large buffers": the floor (a socket pair
per rank, driven from a worker thread, the receiver reading the bytes into
its array), aiospawn's channel and ``ctx.call`` (large buffers through the
group's pool of reused memfds), the same two with a pool of 0 bytes (every
buffer into a fresh memfd, as before the pool), and aiospawn's channel with
the memfd turned off on the supervisor's side (the in-band path every
payload took before memfds), all started once, from
the same fork server with numpy and torch preloaded, and run in alternation,
the order rotating by one peer per trial. Each request sends the payload and
waits for a small answer once the rank holds it unpickled; a task sleeping
1 ms in a loop records the loop's worst gap meanwhile.

Run it from the repository root::

    python benchmarks/bench_shared_memory.py [--trials 7]

It prints a Markdown table: per case and peer, the median time (min-max),
its ratio to the floor's median, and the worst loop gap (median, max), with
the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import anyio

from aiospawn._core._pool import POOL_BYTES_VAR

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_dataplane import (  # found through the path set above
    FLOOR_THREAD,
    HERE,
    LARGE,
    AiospawnCall,
    AiospawnChannel,
    Case,
    SocketThread,
    Transport,
    _load,
    _missing_kind,
    _prepare_workers,
    _runner,
    cases,
    make_payload,
)


@contextlib.contextmanager
def _no_pool() -> Iterator[None]:
    """Groups opened meanwhile send every large buffer in a fresh memfd (a pool of 0 bytes)."""
    before = os.environ.get(POOL_BYTES_VAR)
    os.environ[POOL_BYTES_VAR] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[POOL_BYTES_VAR]
        else:
            os.environ[POOL_BYTES_VAR] = before


class AiospawnChannelNoPool(AiospawnChannel):
    """aiospawn's channel without the group's pool: each buffer into a fresh memfd."""

    name = "aiospawn channel, no pool"

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        with _no_pool():  # read as the group makes its ranks' channels
            await super().open(stack, scratch)


class AiospawnCallNoPool(AiospawnCall):
    """``ctx.call`` without the group's pool: each argument into a fresh memfd."""

    name = "aiospawn ctx.call, no pool"

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        with _no_pool():
            await super().open(stack, scratch)


class AiospawnInBand(AiospawnChannel):
    """aiospawn's channel with the supervisor's memfds off: the payload goes in the pickle."""

    name = "aiospawn channel, in band"

    async def open(self, stack: contextlib.AsyncExitStack, scratch: str) -> None:
        await super().open(stack, scratch)
        for rank in range(len(self.group.pids())):
            # An attribute of this group's links alone: the other groups keep theirs.
            self.group.channel(rank)._conversation._link.shares_memory = False  # type: ignore[attr-defined]


def bulk_cases() -> list[Case]:
    return [
        case
        for case in cases(quick=False)
        if case.size == LARGE and case.kind in ("numpy", "torch") and not _missing_kind(case.kind)
    ]


async def main(trials: int) -> None:
    _prepare_workers(HERE)
    print(f"Load average before the workers started: {_load()}.\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="aiospawn-bench-") as scratch:
        async with contextlib.AsyncExitStack() as stack:
            transports: list[Transport] = []
            for kind in (
                SocketThread,
                AiospawnChannel,
                AiospawnCall,
                AiospawnChannelNoPool,
                AiospawnCallNoPool,
                AiospawnInBand,
            ):
                transport = kind()
                await transport.open(stack, scratch)
                transports.append(transport)
            for case in bulk_cases():
                payload: Any = make_payload(case.kind, case.size)
                runners = {t.name: _runner(t, case, payload) for t in transports}
                for run in runners.values():  # one untimed warm-up each
                    await run()
                times: dict[str, list[float]] = {name: [] for name in runners}
                gaps: dict[str, list[float]] = {name: [] for name in runners}
                load = _load()
                names = list(runners)
                for trial in range(trials):
                    shift = trial % len(names)
                    for name in names[shift:] + names[:shift]:
                        measure = await runners[name]()
                        times[name].append(measure["time [ms]"])
                        gaps[name].append(measure["worst loop gap [ms]"])
                floor = statistics.median(times[FLOOR_THREAD])
                for name in names:
                    median = statistics.median(times[name])
                    rows.append(
                        f"| {case.name} | {name} | {median:.1f} ({min(times[name]):.1f}-"
                        f"{max(times[name]):.1f}) | {median / floor:.2f}x |"
                        f" {statistics.median(gaps[name]):.1f} / {max(gaps[name]):.1f} | {load} |"
                    )
                del payload, runners
    print(
        "| case | peer | time [ms], median (min-max) | ratio to floor"
        " | worst loop gap [ms], median / max | load at the case's start |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nLoad average after: {_load()}. {trials} trials per case, peers in rotation.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=7, help="trials per case (default 7)")
    anyio.run(main, parser.parse_args().trials)
