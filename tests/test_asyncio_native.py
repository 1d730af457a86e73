"""Plain asyncio code (pytest-asyncio, no anyio in sight) using aiospawn.

asyncio.timeout, wait_for, TaskGroup and Task.cancel() cancel through native
``Task.cancel()`` calls; every rank must still be shut down and reaped before
the cancellation (or the TimeoutError made from it) reaches the caller.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

import aiospawn
from tests import ranks
from tests.helpers import Events, drain, is_reaped, receive, receive_ready


@pytest.mark.asyncio
async def test_start_processes_returns_the_results() -> None:
    assert await aiospawn.start_processes(ranks.rank_times, (5,), nprocs=2) == [0, 5]


@pytest.mark.asyncio
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_asyncio_timeout_raises_timeout_error_after_every_rank_is_reaped(
    start_method: str, events: Events
) -> None:
    reader, writer = events
    pids: dict[int, int] = {}

    async def expire_once_ready(deadline: asyncio.Timeout) -> None:
        pids.update(await receive_ready(reader, 2))
        deadline.reschedule(asyncio.get_running_loop().time())

    async def supervise() -> None:
        async with asyncio.timeout(None) as deadline:
            expire = asyncio.create_task(expire_once_ready(deadline))
            await aiospawn.start_processes(
                ranks.api_record_sigterm,
                (writer,),
                nprocs=2,
                start_method=start_method,
                grace_period=1,
            )
        await expire

    with pytest.raises(TimeoutError):
        await supervise()
    assert all(is_reaped(pid) for pid in pids.values())
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]


@pytest.mark.asyncio
async def test_wait_for_times_out_after_every_rank_is_reaped(events: Events) -> None:
    reader, writer = events
    call = aiospawn.start_processes(ranks.api_record_sigterm, (writer,), nprocs=2, grace_period=1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call, timeout=2)
    messages = drain(reader)
    ready = {message[1]: message[2] for message in messages if message[0] == "ready"}
    assert all(is_reaped(pid) for pid in ready.values())
    # Every rank that was running got a SIGTERM first.
    terms = sorted(message for message in messages if message[0] == "SIGTERM")
    assert terms == [("SIGTERM", rank) for rank in sorted(ready)]


@pytest.mark.asyncio
async def test_a_failing_sibling_in_a_task_group_cancels_start_processes(
    events: Events,
) -> None:
    reader, writer = events
    pids: dict[int, int] = {}

    async def fail_once_ready() -> None:
        pids.update(await receive_ready(reader, 2))
        raise ValueError("a sibling task failed")

    async def supervise() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(
                aiospawn.start_processes(
                    ranks.api_record_sigterm, (writer,), nprocs=2, grace_period=1
                )
            )
            tg.create_task(fail_once_ready())

    with pytest.raises(ExceptionGroup) as info:
        await supervise()
    assert [type(exc) for exc in info.value.exceptions] == [ValueError]
    assert all(is_reaped(pid) for pid in pids.values())
    assert sorted(drain(reader)) == [("SIGTERM", 0), ("SIGTERM", 1)]


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["start_processes", "join", "open_group"])
async def test_a_second_native_cancel_does_not_abandon_the_ranks(
    call: str, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiospawn")
    reader, writer = events
    args = (ranks.api_record_sigterm, (writer, True), 2)  # ranks that ignore SIGTERM

    async def supervise() -> None:
        if call == "start_processes":
            await aiospawn.start_processes(*args, grace_period=1)
        elif call == "join":
            ctx = await aiospawn.start_processes(*args, join=False, grace_period=1)
            await ctx.join()
        else:
            async with aiospawn.open_group(*args, grace_period=1):
                await asyncio.Event().wait()

    task = asyncio.create_task(supervise())
    pids = await receive_ready(reader, 2)
    task.cancel()
    reports = {await receive(reader, "SIGTERM report") for _ in range(2)}
    assert reports == {("SIGTERM", 0), ("SIGTERM", 1)}  # the grace period is running
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert all(is_reaped(pid) for pid in pids.values())
    kills = [r.getMessage() for r in caplog.records if "SIGKILL" in r.getMessage()]
    assert len(kills) == 2
