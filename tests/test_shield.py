"""run_to_completion: cleanup that no cancellation cuts short, on trio and asyncio."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aiospawn._core._concurrency import run_to_completion

# Its subject is the glue between the group and the event loop: both loops.
pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]


class Cleanup:
    """A cleanup that starts, waits until the test lets it go, then finishes or raises."""

    def __init__(self, error: Exception | None = None) -> None:
        self.started = anyio.Event()
        self.release = anyio.Event()
        self.finished = False
        self.error = error

    async def __call__(self) -> str:
        self.started.set()
        await self.release.wait()
        await anyio.lowlevel.checkpoint()
        if self.error is not None:
            raise self.error
        self.finished = True
        return "cleaned up"


async def test_the_cleanup_finishes_despite_a_cancelled_scope() -> None:
    cleanup = Cleanup()
    results: list[str] = []
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            results.append(await run_to_completion(cleanup))
            await anyio.sleep_forever()  # the scope's cancellation lands here

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await cleanup.started.wait()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not cleanup.finished
        cleanup.release.set()
    assert cleanup.finished
    assert results == ["cleaned up"]
    assert scope.cancelled_caught


async def test_the_cleanup_runs_when_the_scope_was_cancelled_before_it_began() -> None:
    cleanup = Cleanup()
    cleanup.release.set()
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await run_to_completion(cleanup) == "cleaned up"
    assert cleanup.finished


async def test_an_exception_from_the_cleanup_propagates() -> None:
    error = ValueError("cleanup failed")
    cleanup = Cleanup(error)
    cleanup.release.set()
    with pytest.raises(ValueError, match="cleanup failed") as info:
        await run_to_completion(cleanup)
    assert info.value is error


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_double_cancel_does_not_interrupt_the_cleanup_and_is_reraised() -> None:
    cleanup = Cleanup()
    task = asyncio.ensure_future(run_to_completion(cleanup))
    await cleanup.started.wait()
    task.cancel()
    await anyio.wait_all_tasks_blocked()
    task.cancel()
    await anyio.wait_all_tasks_blocked()
    assert not task.done()
    assert not cleanup.finished
    cleanup.release.set()
    await asyncio.wait([task])
    assert cleanup.finished
    assert task.cancelled()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_exception_from_the_cleanup_wins_over_a_native_cancel() -> None:
    error = ValueError("cleanup failed")
    cleanup = Cleanup(error)
    task = asyncio.ensure_future(run_to_completion(cleanup))
    await cleanup.started.wait()
    task.cancel()
    await anyio.wait_all_tasks_blocked()
    cleanup.release.set()
    await asyncio.wait([task])
    assert task.exception() is error
