"""Small concurrency tools the supervision and the backends share.

- :func:`run_to_completion`: cleanup that finishes whatever cancellation
  arrives meanwhile. An anyio shielded cancel scope stops anyio and trio
  cancellation, but on asyncio a native ``Task.cancel()`` (from
  ``asyncio.timeout``, ``wait_for``, a ``TaskGroup`` or user code) still
  interrupts whatever the task awaits. So on asyncio the cleanup runs in a
  task of its own, and the caller awaits it through ``asyncio.shield`` until
  it is done, then re-raises the cancellation it absorbed.
- :class:`Broadcast`: wakes every task waiting for "something changed".
- :class:`SingleWatcher`: one task at a time does a wait that only one may
  do (an fd has one waiter); the others wait for it, and one of them takes
  over if it is cancelled.
- :func:`start_owner`: start a group's owner as a task of the event loop
  itself, for the forms of the API that have no scope of their own.
- :func:`take_turn`: work that many tasks do in one pass of the loop (64
  ranks signalled, or reaped as they die together) shares the loop thread's
  CPU in slices of :data:`CPU_SLICE`.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from anyio.lowlevel import checkpoint

from ._loops import runs_asyncio

T = TypeVar("T")

#: Seconds of the loop thread's own CPU time that :func:`take_turn`'s callers
#: may spend before the loop runs other tasks. CPU time, which the loop thread
#: alone spends, not the wall clock, which its system calls stretch: 64 fork
#: ranks woken by SIGTERM take the cores from the loop thread, and a slice of
#: 1 ms of CPU took 15-19 ms of wall clock. With 5 ms slices the teardown of
#: 64 fork ranks stalled the loop 43-62 ms, against 16-20 ms with 1 ms slices,
#: for the same teardown time and system time (quiet 2-core machine, 2026-12-03).
CPU_SLICE = 0.001

#: When this thread's current slice began (``time.thread_time()``): one loop
#: per thread, so one slice per thread.
_slice = threading.local()

#: The owners started on asyncio loops: the loop holds its tasks weakly.
_owners: set[Any] = set()


async def run_to_completion(fn: Callable[[], Awaitable[T]]) -> T:
    """Await ``fn()`` to its end, even if the calling task is cancelled meanwhile.

    Returns:
        What ``fn()`` returned.

    Raises:
        Whatever ``fn()`` raised; otherwise, a native asyncio cancellation that
        arrived while it ran, re-raised once it has finished.
    """
    if not runs_asyncio():  # trio
        with anyio.CancelScope(shield=True):
            result = await fn()
        return result
    import asyncio  # loaded already

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


class Broadcast:
    """Wakes every task waiting in :meth:`wait` when :meth:`notify` is called.

    An ``anyio.Event`` can be set only once, so each notification sets the
    current one and the next waiter makes a fresh one. A waiter checks its
    condition, then waits, with no checkpoint in between, so no notification
    can fall between the two. With nobody waiting a notification does nothing:
    some are made for every line a rank writes, and a new ``anyio.Event``
    costs microseconds (a backend lookup), which short lines turn into a
    stalled loop.
    """

    def __init__(self) -> None:
        # Made by the first waiter: a group holds dozens of these, most of
        # which nobody ever waits on.
        self._event: Any = None
        self._waiters = 0
        # On asyncio, asyncio's own Event: anyio's looks its backend up each
        # time one is made, a cost paid for every message on a channel.
        self._make_event: Callable[[], Any] | None = None

    def notify(self) -> None:
        """Wake the tasks waiting now; later waiters wait for the next call."""
        if self._waiters and self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        """Wait for the next :meth:`notify`."""
        if self._event is None:
            if self._make_event is None:
                self._make_event = anyio.Event
                if runs_asyncio():
                    import asyncio  # loaded already

                    self._make_event = asyncio.Event
            self._event = self._make_event()
        event = self._event
        self._waiters += 1
        try:
            await event.wait()
        finally:
            self._waiters -= 1


class SingleWatcher:
    """Lets one task at a time run a watch; the other callers wait for it.

    The watch (``watch()`` passed to :meth:`run`) is a wait only one task may
    do at a time: waiting on an fd (a second waiter gets ``BusyResourceError``)
    or supervising a group. When the watcher returns or is cancelled, the
    waiters wake and look again: if the watch is not finished, one of them
    takes it over where it stopped. (An ``anyio.Lock`` would hand over on
    cancellation too, but it wakes its waiters one at a time.)
    """

    def __init__(self) -> None:
        self._watching = False
        self._ended = Broadcast()  # a watch returned or was cancelled

    async def run(self, finished: Callable[[], bool], watch: Callable[[], Awaitable[None]]) -> None:
        """Return once ``finished()``, watching with ``watch()`` while nobody else does."""
        while not finished():
            if self._watching:
                await self._ended.wait()
                continue
            self._watching = True
            try:
                await watch()
            finally:
                self._watching = False
                self._ended.notify()


def start_owner(owner: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``owner()`` as a task of the running event loop, outside the caller's scope.

    A group started by ``start_processes(join=False)`` outlives the call that
    started it, so its owner cannot be a task of that call's scope: it is a
    task of the loop (on trio, a system task), which the loop cancels when it
    ends (``asyncio.run`` and ``trio.run`` both do). ``owner`` must handle
    that cancellation by stopping and reaping its ranks, and must not raise
    anything else (on trio a system task's error crashes the run).

    The task runs in a copy of the caller's context (``contextvars``), as a
    task started from it would.
    """
    if runs_asyncio():
        import asyncio  # loaded already

        task = asyncio.get_running_loop().create_task(owner())
        _owners.add(task)
        task.add_done_callback(_owners.discard)
        return
    trio = sys.modules["trio"]  # the caller runs in a trio task
    trio.lowlevel.spawn_system_task(owner, context=contextvars.copy_context())


async def take_turn() -> None:
    """Let the loop run other tasks first if this thread's slice of CPU is spent.

    For work done rank after rank, by one task (the SIGTERM of each rank of
    a shutdown) or by many in the same pass of the event loop, which runs
    everything ready in a pass before it looks at its timers (ranks that die
    of the same SIGTERM wake their exit watchers at once, each reaping its
    rank with a few system calls). Called before each share of the work:
    once the slice (:data:`CPU_SLICE`) is spent, every caller waits for a
    later pass, where the first one back begins a new slice. No checkpoint
    while the slice lasts.

    Cancellation:
        A checkpoint only when the slice is spent.
    """
    while True:
        began = getattr(_slice, "began", None)
        if began is not None and time.thread_time() - began < CPU_SLICE:
            return
        if began is not None:
            await checkpoint()
        if getattr(_slice, "began", None) == began:  # the first one back (or the first ever)
            _slice.began = time.thread_time()
            return
        # Another caller came back first and began a slice: this one's share
        # goes into it if it has room.
