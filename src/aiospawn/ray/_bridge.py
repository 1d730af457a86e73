"""Waiting on Ray from anyio: asyncio and trio alike, never blocking the event loop.

Ray's ``ObjectRef`` is awaitable on asyncio only (under trio, awaiting one
fails: no current asyncio loop). ``ObjectRef.future()`` gives a
``concurrent.futures.Future`` instead; its done-callback, which runs on one of
Ray's threads, schedules an ``anyio.Event.set`` on the waiting loop. It never
waits for the loop: a Ray thread blocked on our loop while the loop calls into
Ray could deadlock both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
from anyio.lowlevel import checkpoint


def threadsafe(fn: Callable[[], None]) -> Callable[[], None]:
    """Return a callable that any thread may call to run ``fn`` soon on this event loop.

    It never waits for the loop: the caller is one of Ray's threads, which must
    not block on a loop that may itself be waiting on Ray.
    """
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        loop = native

        def call_asyncio() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                loop.call_soon_threadsafe(fn)

        return call_asyncio

    trio_token: Any = native

    def call_trio() -> None:
        with contextlib.suppress(Exception):  # trio.RunFinishedError
            trio_token.run_sync_soon(fn)

    return call_trio


def done_event(future: Future[Any]) -> anyio.Event:
    """An event of this loop that is set once ``future`` is done. Call it on the loop."""
    event = anyio.Event()
    if future.done():
        event.set()
    else:
        wake = threadsafe(event.set)
        future.add_done_callback(lambda _: wake())
    return event


async def wait_done(future: Future[Any]) -> None:
    """Wait, without blocking the loop, until ``future`` is done. Always checkpoints."""
    if future.done():
        await checkpoint()
        return
    await done_event(future).wait()


async def get(ref: Any) -> Any:
    """``ray.get(ref)`` without blocking the event loop; cancellable."""
    future = ref.future()
    await wait_done(future)
    return future.result()
