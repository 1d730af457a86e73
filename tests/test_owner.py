"""A group's owner drives it whether or not anyone waits on it (real processes).

The owner reaps exits, pumps output and channels, and stops the group after a
failure on its own; it ends with the scope or event loop that started it,
having stopped and reaped every rank. Policy on the fake backend is in
tests/unit; this module holds what only real ranks and sockets show.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import anyio
import pytest

import aiospawn
from tests import owner_ranks, ranks
from tests.helpers import (
    Events,
    drain,
    is_gone,
    is_reaped,
    receive,
    receive_ready,
    tripwire,
    wait_until,
)

pytestmark = pytest.mark.anyio


async def exits_seen(ctx: aiospawn.AsyncProcessContext[Any], nprocs: int) -> list[aiospawn.Exited]:
    """The group's ``Exited`` events, read until ``nprocs`` ranks have exited."""
    exited: list[aiospawn.Exited] = []
    async with contextlib.aclosing(ctx.events()) as events:
        async for event in events:
            if isinstance(event, aiospawn.Exited):
                exited.append(event)
                if len(exited) == nprocs:
                    break
    return exited


async def test_a_group_nobody_joins_is_reaped_and_stopped_after_a_failure() -> None:
    # Rank 1 raises; rank 0 would run until stopped. Nobody joins until the end.
    ctx = await aiospawn.start_processes(ranks.raise_in, (1,), nprocs=2, join=False)
    pids = ctx.pids()
    with tripwire(60, "the owner's shutdown after a failure, nobody joining"):
        exited = await exits_seen(ctx, 2)
    assert {(event.rank, event.stopped_by_us) for event in exited} == {(1, False), (0, True)}
    assert all(is_reaped(pid) for pid in pids)  # before anyone joined

    with pytest.raises(aiospawn.ProcessRaisedException) as info:
        await ctx.join()
    assert info.value.error_index == 1
    assert "legitimate exception from process 1" in str(info.value)


async def test_a_group_nobody_joins_never_blocks_its_ranks_writes(events: Events) -> None:
    reader, writer = events
    # 200 KB through the supervisor's prefixing pump: far more than a pipe holds.
    ctx = await aiospawn.start_processes(
        owner_ranks.write_then_report,
        (200_000, writer),
        nprocs=1,
        join=False,
        stdout="prefix",
    )
    try:
        assert await receive(reader, "report after 200 KB of output", seconds=30) == "written"
    finally:
        with tripwire(60, "join() of a group that wrote 200 KB"):
            assert await ctx.join() is True
    assert ctx.results == ["done"]


async def test_a_send_cancelled_mid_write_in_a_block_is_still_delivered(
    release: Events,
) -> None:
    waiter, sender = release
    message = b"x" * (8 * 1024 * 1024)  # far more than the socket holds
    async with aiospawn.open_group(
        owner_ranks.echo_size_when_told, (waiter,), nprocs=1, wait_ready=True
    ) as ctx:
        channel = ctx.channel(0)
        with anyio.move_on_after(0.3) as cut:
            await channel.send(message)  # the rank reads nothing yet: this waits
        assert cut.cancelled_caught, "the send finished although the rank read nothing"
        sender.send("read now")
        with tripwire(30, "the echo of a send cancelled mid-write"):
            assert await channel.receive() == len(message)


async def test_a_rank_exit_ends_its_channel_though_a_leftover_process_holds_it(
    events: Events, release: Events
) -> None:
    reader, writer = events
    waiter, sender = release
    holder = None
    try:
        async with aiospawn.open_group(
            owner_ranks.leave_a_holder_then_exit, (writer, waiter), nprocs=2
        ) as ctx:
            holder = await receive(reader, "the holder's pid")
            channel = ctx.channel(0)
            assert await channel.receive() == "before"
            with tripwire(30, "receive() after the rank exited, its socket held elsewhere"):
                async with anyio.create_task_group() as tg:

                    async def receive_the_end() -> None:
                        with pytest.raises(anyio.EndOfStream):
                            await channel.receive()

                    tg.start_soon(receive_the_end)
                    await anyio.wait_all_tasks_blocked()  # the receive waits on the socket
                    sender.send("exit now")
            assert is_running(holder), "the holder died: the test proves nothing"
    finally:
        if holder is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
            assert wait_until(lambda: is_gone(holder), 10)


def is_running(pid: int) -> bool:
    return not is_gone(pid)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_group_nobody_joined_is_stopped_and_reaped_when_its_event_loop_ends(
    loop: str, events: Events
) -> None:
    reader, writer = events

    async def main() -> list[int]:
        ctx = await aiospawn.start_processes(
            ranks.api_record_sigterm, (writer,), nprocs=2, join=False
        )
        await receive_ready(reader, 2)
        return ctx.pids()

    pids = anyio.run(main, backend=loop)

    # The loop's end cancelled the owner, which stopped the ranks politely and reaped them.
    assert all(is_reaped(pid) for pid in pids)
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]


@pytest.mark.both_loops
async def test_leaving_a_block_after_its_own_terminate_raises_nothing() -> None:
    async with aiospawn.open_group(owner_ranks.return_or_wait, (0,), nprocs=2) as ctx:
        with tripwire(60, "rank 0's return"):
            async with contextlib.aclosing(ctx.events()) as events:
                async for event in events:
                    if isinstance(event, aiospawn.Exited) and event.rank == 0:
                        break
        await ctx.terminate(grace_period=5)
    # What the rank that finished returned; None for the rank the stop ended.
    assert ctx.results == ["rank 0", None]
    assert ctx.statistics().alive == 0
