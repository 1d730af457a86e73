"""The small concurrency tools: one watcher at a time, taken over on cancel; the broadcast."""

from __future__ import annotations

import anyio
import pytest

from aiospawn._core._concurrency import Broadcast, SingleWatcher

# Its subject is the glue between the group and the event loop: both loops.
pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]


async def test_one_task_watches_and_a_waiter_takes_over_when_it_is_cancelled() -> None:
    watcher = SingleWatcher()
    done = anyio.Event()
    watching: list[str] = []

    async def watch(name: str) -> None:
        watching.append(name)
        assert len(watching) == 1, f"two watchers at once: {watching}"
        try:
            await done.wait()
        finally:
            watching.remove(name)

    finished: list[str] = []

    async def wait(name: str, scope: anyio.CancelScope | None = None) -> None:
        with scope or anyio.CancelScope():
            await watcher.run(done.is_set, lambda: watch(name))
            finished.append(name)

    with anyio.fail_after(10):  # a deadlock tripwire
        async with anyio.create_task_group() as tg:
            first = anyio.CancelScope()
            tg.start_soon(wait, "first", first)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(wait, "second")
            tg.start_soon(wait, "third")
            await anyio.wait_all_tasks_blocked()
            assert watching == ["first"]
            first.cancel()
            await anyio.wait_all_tasks_blocked()
            assert watching in (["second"], ["third"])  # one took over, the other waits
            done.set()
    assert sorted(finished) == ["second", "third"]


async def test_a_broadcast_wakes_every_waiter_and_only_those_waiting() -> None:
    changed = Broadcast()
    woken: list[int] = []

    async def waiter(index: int) -> None:
        await changed.wait()
        woken.append(index)

    with anyio.fail_after(10):  # a deadlock tripwire
        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(waiter, index)
            await anyio.wait_all_tasks_blocked()
            changed.notify()
            await anyio.wait_all_tasks_blocked()
            assert sorted(woken) == [0, 1, 2]
            tg.start_soon(waiter, 3)
            await anyio.wait_all_tasks_blocked()
            assert 3 not in woken  # the late waiter waits for the next notify
            changed.notify()
    assert 3 in woken
