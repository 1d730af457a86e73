"""Run cleanup to completion, whatever cancellation arrives meanwhile.

An anyio shielded cancel scope stops anyio and trio cancellation, but on
asyncio a native ``Task.cancel()`` (from ``asyncio.timeout``, ``wait_for``,
a ``TaskGroup`` or user code) still interrupts whatever the task awaits. So on
asyncio the cleanup runs in a task of its own, and the caller awaits it through
``asyncio.shield`` until it is done, then re-raises the cancellation it absorbed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def run_to_completion(fn: Callable[[], Awaitable[T]]) -> T:
    """Await ``fn()`` to its end, even if the calling task is cancelled meanwhile.

    Returns:
        What ``fn()`` returned.

    Raises:
        Whatever ``fn()`` raised; otherwise, a native asyncio cancellation that
        arrived while it ran, re-raised once it has finished.
    """
    try:
        asyncio.current_task()
    except RuntimeError:  # no asyncio loop in this thread: trio
        with anyio.CancelScope(shield=True):
            result = await fn()
        return result

    async def shielded() -> T:
        with anyio.CancelScope(shield=True):
            result = await fn()
        return result

    cleanup = asyncio.ensure_future(shielded())
    absorbed: asyncio.CancelledError | None = None
    # The shielded scope keeps anyio from re-delivering its (level-triggered)
    # cancellation on every iteration; only native cancels get through, once each.
    with anyio.CancelScope(shield=True):
        while not cleanup.done():
            try:
                await asyncio.shield(cleanup)
            except asyncio.CancelledError as exc:
                absorbed = exc
    result = cleanup.result()
    if absorbed is not None:
        raise absorbed
    return result
