"""Which event loop runs the caller (``aiospawn._core._loops``): asyncio, trio, a guest, none."""

from __future__ import annotations

import asyncio
from typing import Any

import trio

from aiospawn._core._loops import running_asyncio_loop, running_loop, runs_asyncio


def seen() -> tuple[str | None, bool, Any]:
    return running_loop(), runs_asyncio(), running_asyncio_loop()


def test_no_loop_outside_one_and_in_a_worker_thread_of_one() -> None:
    assert seen() == (None, False, None)

    async def from_a_worker_thread() -> tuple[str | None, bool, Any]:
        return await asyncio.to_thread(seen)

    assert asyncio.run(from_a_worker_thread()) == (None, False, None)


def test_asyncio_names_its_running_loop() -> None:
    async def main() -> tuple[tuple[str | None, bool, Any], asyncio.AbstractEventLoop]:
        return seen(), asyncio.get_running_loop()

    (name, on_asyncio, loop), running = asyncio.run(main())
    assert (name, on_asyncio, loop) == ("asyncio", True, running)


def test_trio_is_trio_in_a_task_and_outside_one() -> None:
    outside: list[tuple[bool, str | None, bool, Any]] = []

    class Probe(trio.abc.Instrument):
        # Called by the run before its first task, in no task.
        def before_run(self) -> None:
            outside.append((trio.lowlevel.in_trio_task(), *seen()))

    async def main() -> tuple[str | None, bool, Any]:
        return seen()

    assert trio.run(main, instruments=[Probe()]) == ("trio", False, None)
    assert outside == [(False, "trio", False, None)]


def test_a_trio_guest_on_asyncio_is_trio_in_its_tasks_and_asyncio_in_the_hosts() -> None:
    async def trio_main() -> tuple[str | None, bool, Any]:
        return seen()

    async def host() -> tuple[tuple[str | None, bool, Any], Any, asyncio.AbstractEventLoop]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        in_host = seen()
        outcome = await done
        return in_host, outcome.unwrap(), loop

    in_host, in_guest, loop = asyncio.run(host())
    assert in_host == ("asyncio", True, loop)
    # The guest's tasks run in the host's callbacks: asyncio's loop runs, yet
    # asyncio primitives would break a trio task.
    assert in_guest == ("trio", False, loop)
