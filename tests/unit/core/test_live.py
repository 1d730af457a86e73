"""The live ranks' object alone: channels per attempt, replaced with their attempts.

The test plays the group: it says which attempt holds each slot and when an
attempt is replaced; each attempt's channel is a ``MemoryLink`` whose rank's
end the test plays. How channels, readiness and calls behave inside a running
group is tested in tests/unit/core/test_conversation.py.
"""

from __future__ import annotations

import pickle
from typing import cast

import anyio
import pytest

from aiospawn._core._backend import RankHandle
from aiospawn._core._concurrency import Broadcast
from aiospawn._core._events import EventLog, Ready
from aiospawn._core._live import LiveRanks
from aiospawn._core._outcome import RankExit
from aiospawn._rank.wire import Link as Frame
from tests.fake_backend import MemoryLink
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio


class Attempt:
    """The little of a rank attempt the live ranks read: its rank, pid and link."""

    def __init__(self, rank: int, pid: int, *, links: bool = True) -> None:
        self.rank = rank
        self.pid = pid
        self.link = MemoryLink() if links else None


class Slots:
    """The group as :class:`LiveRanks` sees it: the current attempt at each rank."""

    def __init__(self, nprocs: int, *, links: bool = True) -> None:
        self.attempts = [Attempt(rank, 100 + rank, links=links) for rank in range(nprocs)]
        self.events = EventLog()
        self.live = LiveRanks(
            nprocs,
            lambda index: cast("RankHandle", self.attempts[index]),
            transport="FakeLauncher",
            events=self.events,
            changed=Broadcast(),
            on_broken=lambda rank, broken: None,
            exit_of=self.exit_of,
        )
        for attempt in self.attempts:
            self.live.add(cast("RankHandle", attempt))

    async def exit_of(self, rank: RankHandle) -> RankExit | None:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    def replace(self, rank: int) -> Attempt:
        """Put a new attempt in slot ``rank``, as a restart does."""
        old = self.attempts[rank]
        fresh = Attempt(rank, old.pid + 10)
        self.live.add(cast("RankHandle", fresh))
        self.live.forget([cast("RankHandle", old)])
        self.attempts[rank] = fresh
        return fresh

    def link(self, rank: int) -> MemoryLink:
        found = self.attempts[rank].link
        assert isinstance(found, MemoryLink)
        return found

    async def pump(self, rank: int) -> None:
        """Let the channel of ``rank``'s attempt move what it can, then stop it."""
        pump = self.live.pump(cast("RankHandle", self.attempts[rank]))
        assert pump is not None
        with tripwire(10, "a channel's pump"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()


async def test_a_rank_is_named_by_an_int_in_the_group() -> None:
    slots = Slots(2)
    with pytest.raises(TypeError, match="rank must be an int, got True"):
        slots.live.channel(True)
    with pytest.raises(ValueError, match="rank 2 is not in this group of 2"):
        slots.live.channel(2)
    assert slots.live.channel(1).rank == 1


async def test_ranks_without_links_have_no_channels() -> None:
    slots = Slots(2, links=False)
    assert slots.live.pump(cast("RankHandle", slots.attempts[0])) is None
    with pytest.raises(RuntimeError, match="FakeLauncher's ranks have no channels"):
        slots.live.check()


async def test_a_replaced_attempt_takes_its_channel_with_it() -> None:
    slots = Slots(2)
    old_link = slots.link(1)
    old = slots.live.channel(1)
    fresh = slots.replace(1)
    assert old_link.released
    assert slots.live.channel(1) is not old
    await slots.live.channel(1).send("for the new attempt")
    await slots.pump(1)
    [(kind, payload)] = slots.link(1).read()
    assert (kind, pickle.loads(payload)) == (Frame.MESSAGE, "for the new attempt")
    assert fresh.link is slots.link(1)


async def test_closing_the_sending_side_reaches_later_attempts_too() -> None:
    slots = Slots(2)
    slots.live.close_sending()
    slots.replace(0)
    for rank in (0, 1):
        await slots.pump(rank)
        assert [kind for kind, _ in slots.link(rank).read()] == [Frame.CLOSE]


async def test_ready_payloads_come_in_rank_order_once_every_rank_is_ready() -> None:
    slots = Slots(2)
    slots.link(1).ready({"port": 1})
    await slots.pump(1)
    assert not slots.live.all_ready()
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) 0 did not call aiospawn.ready\(\) within 5 s"
    ):
        await slots.live.ready_payloads(5.0)
    with pytest.raises(RuntimeError, match=r"rank\(s\) 0 returned first"):
        await slots.live.ready_payloads(None)
    slots.link(0).ready({"port": 0})
    await slots.pump(0)
    assert slots.live.all_ready()
    assert await slots.live.ready_payloads(None) == [{"port": 0}, {"port": 1}]
    slots.events.close()
    events = [
        (type(event), event.rank, event.pid)
        async for event in slots.events.follow()
        if isinstance(event, Ready)
    ]
    assert events == [(Ready, 1, 101), (Ready, 0, 100)]
