"""AsyncProcessContext.send_signal(): a signal passed on to the running ranks; the group goes on."""

from __future__ import annotations

import signal
from typing import Any

import pytest

import aiospawn
from aiospawn._local import _templates
from tests import ranks
from tests.fake_backend import FakeBackend, start_group
from tests.helpers import Events, receive, receive_ready, tripwire, wait_exits_seen

pytestmark = pytest.mark.anyio


#: How the ranks start: each start method, and warm from a template (which reaps its ranks).
STARTS = {
    "spawn": {"start_method": "spawn"},
    "forkserver": {"start_method": "forkserver"},
    "fork": {"start_method": "fork"},
    "warm": {"preload": ["tests.ranks"]},
}


@pytest.mark.parametrize("start", list(STARTS))
async def test_send_signal_reaches_each_running_rank_and_its_process_group(
    events: Events, start: str
) -> None:
    reader, writer = events
    try:
        async with aiospawn.open_group(
            ranks.checkpoint_on_sigusr1, (writer, 1), nprocs=3, **STARTS[start]
        ) as ctx:
            await receive_ready(reader, 2)
            with tripwire(30, "rank 1's return"):
                await wait_exits_seen(ctx, 1)
            assert ctx.send_signal(signal.SIGUSR1) == [0, 2]
            seen = {await receive(reader, "a report of the signal") for _ in range(4)}
            assert seen == {
                ("SIGUSR1", 0),
                ("SIGUSR1", 2),
                ("child", 0, -signal.SIGUSR1),
                ("child", 2, -signal.SIGUSR1),
            }
        assert ctx.results == ["checkpointed", "returned", "checkpointed"]
    finally:
        _templates.stop_all()  # the warm start's template outlives its group


async def test_a_rank_that_dies_of_a_signal_passed_on_fails_the_group(events: Events) -> None:
    reader, writer = events
    ctx = await aiospawn.start_processes(ranks.api_record_sigterm, (writer,), nprocs=2, join=False)
    await receive_ready(reader, 2)
    # Not a stop of ours: the deaths are the group's failure, not a requested end.
    assert ctx.send_signal(signal.SIGUSR2) == [0, 1]
    with (
        tripwire(30, "join() after the ranks died"),
        pytest.raises(aiospawn.ProcessExitedException) as caught,
    ):
        await ctx.join()
    assert caught.value.signal_name == "SIGUSR2"
    assert "sent by aiospawn" not in str(caught.value)
    # The other rank may be dying of it too when the shutdown signals it: only
    # the root cause is sure to read as the rank's own death.
    root = ctx.statistics().ranks[caught.value.error_index].last_exit
    assert root is not None
    assert (root.signal_name, root.stopped_by_us) == ("SIGUSR2", False)


@pytest.mark.parametrize(
    ("signum", "error"),
    [
        ("SIGUSR1", TypeError),
        (True, TypeError),
        (10.0, TypeError),
        (0, ValueError),
        (-1, ValueError),
        (4096, ValueError),
        (signal.SIGKILL, ValueError),
        (signal.SIGSTOP, ValueError),
    ],
)
async def test_send_signal_refuses_what_is_not_a_signal(
    signum: Any, error: type[Exception]
) -> None:
    ctx = await start_group(FakeBackend(), nprocs=1)
    with pytest.raises(error, match="signal"):
        ctx.send_signal(signum)
    await ctx.terminate()


async def test_send_signal_refuses_a_backend_that_cannot_signal_its_ranks() -> None:
    ctx = await start_group(FakeBackend(), nprocs=1)
    with pytest.raises(RuntimeError, match="cannot pass signals"):
        ctx.send_signal(signal.SIGUSR1)
    await ctx.terminate()
