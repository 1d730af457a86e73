"""The small concurrency tools: one watcher at a time, taken over on cancel; the broadcast;
CPU slices for work many tasks do at once."""

from __future__ import annotations

import time

import anyio
import pytest

from aiospawn._core._concurrency import CPU_SLICE, Broadcast, SingleWatcher, take_turn

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


def _burn(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU (what a rank's reaping costs the loop)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_work_that_many_tasks_do_at_once_lets_the_loop_run_between_slices() -> None:
    # 20 tasks made ready in the same pass, each with 0.4 ms of work: 8 ms in
    # all, which would run back to back before anything else. Taking turns,
    # the loop passes to other tasks (the ticker) once a slice is spent.
    order: list[str] = []
    share = CPU_SLICE * 0.4

    async def worker() -> None:
        await take_turn()
        _burn(share)
        order.append("w")

    async def ticker() -> None:
        while True:
            order.append("t")
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(10):  # a deadlock tripwire
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            async with anyio.create_task_group() as workers:
                for _ in range(20):
                    workers.start_soon(worker)
            tg.cancel_scope.cancel()
    work = "".join(order)
    between = work[work.index("w") : work.rindex("w")]
    assert between.count("w") == 19
    # 8 ms of work in slices of 1 ms: the loop ran other tasks at least 4 times
    # (not 7: a slice's last share may run past its end).
    assert between.count("t") >= 4, work
    # And never after each share: a slice holds more than one.
    assert "ww" in between, work
