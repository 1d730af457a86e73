"""Output that nobody reads, or that never ends, must neither block a rank nor the loop.

A ``capture`` stream nobody iterates would fill its buffer and then hold the
rank back for ever; a process the rank left behind that keeps its output pipe
open would keep the supervisor reading after the rank's exit. Each case runs
real ranks under asyncio and trio (the pipe-level case aside).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import anyio
import psutil
import pytest

import aiospawn
from aiospawn._core._capture import CAPTURE_BUFFER_LINES
from tests import escape_ranks
from tests.conftest import wait_until
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio

#: More lines than the capture buffer holds.
MANY = 3 * CAPTURE_BUFFER_LINES


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("start", [aiospawn.start_processes, aiospawn.spawn])
async def test_capture_with_join_true_is_refused_before_anything_starts(
    start: object, stream: str
) -> None:
    assert callable(start)
    with pytest.raises(ValueError, match=r"open_group.*join=False.*ctx\.output\(\)"):
        await start(escape_ranks.write_lines, (1,), nprocs=1, **{stream: "capture"})


async def test_capture_without_a_consumer_keeps_the_newest_lines_and_never_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    ctx = await aiospawn.start_processes(
        escape_ranks.write_lines, (MANY,), nprocs=1, join=False, stdout="capture"
    )
    with tripwire(60, "a rank writing more captured lines than the buffer holds"):
        await ctx.join()
    assert ctx.results == [MANY]
    lines = [item.line async for item in ctx.output()]
    assert lines == [f"line {index}" for index in range(MANY - CAPTURE_BUFFER_LINES, MANY)]
    assert "dropping the oldest captured lines" in caplog.text


async def test_a_consumer_that_stops_iterating_no_longer_holds_the_ranks_back() -> None:
    ctx = await aiospawn.start_processes(
        escape_ranks.write_lines, (MANY,), nprocs=1, join=False, stdout="capture"
    )
    with tripwire(60, "a rank held back by a consumer that stopped iterating"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctx.join)
            output = ctx.output()
            first = await anext(output)
            await output.aclose()
    assert first.line == "line 0"
    assert ctx.results == [MANY]


async def _max_lag(period: float, lags: list[float]) -> None:
    """Tick every ``period`` seconds and record how late each tick was."""
    while True:
        before = time.monotonic()
        await anyio.sleep(period)
        lags.append(time.monotonic() - before - period)


@pytest.mark.parametrize("mode", ["prefix", "capture"])
@pytest.mark.alone  # it bounds a duration
async def test_a_descendant_holding_the_output_pipe_stalls_neither_the_loop_nor_join(
    mode: str,
) -> None:
    lags: list[float] = []
    with tripwire(60, f"join() of a rank whose `yes` keeps its {mode} pipe open"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_max_lag, 0.01, lags)
            ctx = await aiospawn.start_processes(
                escape_ranks.leave_yes_running, nprocs=1, join=False, stdout=mode
            )
            await ctx.join()
            tg.cancel_scope.cancel()
    (yes,) = ctx.results
    assert wait_until(lambda: not psutil.pid_exists(yes)), "`yes` survived its rank"
    assert lags, "the ticker never ran"
    # Generous: the point is "moments", against the seconds seen before.
    assert max(lags) < 0.5, f"the event loop stalled {max(lags):.3f} s"


async def test_the_final_drain_reads_what_the_pipe_holds_and_stops() -> None:
    # A writer that is always ahead of the reader: every line read puts another
    # one in the pipe, as a `yes` that outlives its rank does, only deterministically.
    from aiospawn._local import _output

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    seen = 0

    def refill(line: bytes) -> None:
        nonlocal seen
        seen += 1
        with contextlib.suppress(BlockingIOError):  # full: the next read makes room
            os.write(write_end, b"y\n")

    stream = _output.StreamReader(read_end, "stdout", [refill], None)
    stream.prepare()
    held = 0
    try:
        while True:
            held += os.write(write_end, b"y\n" * 1024)
    except BlockingIOError:
        pass  # the pipe is full
    try:
        stream.drain()  # closes the read end
    finally:
        os.close(write_end)
    # What the pipe held at the call, split into lines, and nothing more.
    assert seen == math.ceil(held / 2)
