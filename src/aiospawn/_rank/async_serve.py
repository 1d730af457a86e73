"""``await aiospawn.serve(handler)`` in an async rank: each call its own task, cancellable.

A sync rank answers calls one at a time (``channel.Channel.serve``). An async
rank runs the ``async def`` method of each CALL in a task of its own, on the
rank's loop, so that calls overlap: three calls that each wait a second take a
second together. A CANCEL frame (the supervisor's call was cancelled, or timed
out) cancels the task of the call it names, whose ``finally`` blocks then run;
it sends no answer (the supervisor would drop it). ``limit`` bounds the calls
that run at once; the rest wait in the order they came, and a CANCEL drops a
waiting call unrun::

    socket ─► Frames ─► calls ──► dispatch ─► running (≤ limit): a task each ─► REPLY
                    └─► cancels ─┘        └─► waiting ──(a task ends)──┘
                      (of calls taken)        (a CANCEL drops it)

A sync method runs where the call starts, in the dispatch loop, and is
answered there: it holds the loop until it returns whatever task runs it, so
a task would only add its cost (a sizeable part of a short call's).

The dispatch loop and the calls are tasks of one task group (a trio nursery,
an ``asyncio.TaskGroup``), and none of them raises out of it but a
cancellation: what ends ``serve()`` is kept and raised after the group, as it
is. So ``serve()`` raises what it raised when calls ran one at a time:

- the supervisor closed the channel: ``serve()`` returns once the calls
  running or waiting have answered;
- the channel broke, or the rank closed it: that error, once the running calls
  are cancelled;
- a handler raised a ``BaseException`` that is not an ``Exception`` (say
  ``SystemExit``), or a cancellation the supervisor did not ask for: that
  exception, once the other calls are cancelled;
- the task that awaits ``serve()`` is cancelled (SIGTERM cancels the rank's
  main task): every call is cancelled, then the cancellation goes on.

Part of the rank-side package: standard library only. The event loop is the
one the rank runs (``async_main``), imported by it.
"""

from __future__ import annotations

import collections

from .channel import answer, reply
from .wire import Link, call_id_of, from_fn

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine
    from typing import Any

    from .frames import Frames
    from .wire import Payload

    #: ``(CANCEL, call id)`` or ``(CALL, frame)``, given whether calls are running.
    NextRequest = Callable[[bool], Awaitable[tuple[int, int | Payload]]]


class Calls:
    """The calls one ``serve()`` runs, waits to run, and was asked to cancel.

    The loop-specific parts (run a handler's coroutine in a task, run a
    coroutine, cancel them all) are callables that :func:`serve_asyncio` and
    :func:`serve_trio` set.
    """

    def __init__(
        self,
        frames: Frames,
        next_request: NextRequest,
        flush: Callable[[], Awaitable[None]],
        handler: Any,
        limit: int | None,
    ) -> None:
        """Hold no call yet.

        Args:
            frames: The rank's end of its channel.
            next_request: The channel's wait for the next CANCEL or CALL.
            flush: The channel's wait until everything queued is written.
            handler: What ``serve()`` was given.
            limit: The most calls that run at once, or None.
        """
        self.frames = frames
        self._next_request = next_request
        self._flush = flush
        self.handler = handler
        self.limit = limit
        #: Call id -> what cancels its task, while its handler runs.
        self.running: dict[int, Callable[[], object]] = {}
        self.waiting: collections.deque[Payload] = collections.deque()
        #: Calls whose task was cancelled at the supervisor's request.
        self.cancelled: set[int] = set()
        #: True once ``serve()`` ends: no waiting call starts any more.
        self.stopping = False
        #: What ends ``serve()``, raised once every task has ended.
        self.error: BaseException | None = None
        #: Starts the task of call ``id`` awaiting ``awaitable``; what cancels it, if it started.
        self.run_call: Callable[[int, Any], Callable[[], object] | None] = _unset
        #: Runs a coroutine in a task of the group.
        self.spawn: Callable[[Coroutine[Any, Any, None]], object] = _unset
        self.stop_all: Callable[[], None] = _unset

    def take(self, call: Payload) -> None:
        """A CALL taken off the channel: start it, or keep it until a task ends."""
        if self.limit is not None and len(self.running) >= self.limit:
            self.waiting.append(call)
        else:
            self.start(call)

    def start(self, call: Payload) -> None:
        """Run a sync method and answer; give an ``async def`` one's coroutine a task."""
        try:
            call_id, ok, value = answer(self.handler, call)
        except BaseException as exc:  # a sync method's SystemExit or KeyboardInterrupt
            self.fail(exc)
            return
        if ok and hasattr(value, "__await__"):
            stop = self.run_call(call_id, value)
            if stop is not None:
                self.running[call_id] = stop
        else:
            self.answer_now(call_id, ok, value)

    def cancel(self, call_id: int) -> None:
        """The supervisor gave up on ``call_id``: cancel its task, or drop it unrun."""
        stop = self.running.get(call_id)
        if stop is not None:
            self.cancelled.add(call_id)
            stop()
            return
        for index, call in enumerate(self.waiting):
            if call_id_of(call) == call_id:
                del self.waiting[index]
                return
        # Else it has answered already: the supervisor drops that answer.

    def ended(self, call_id: int) -> None:
        """A call's handler is done (its answer may still be on its way): the next may start."""
        del self.running[call_id]
        self.cancelled.discard(call_id)
        # A waiting sync method runs and answers at once: the next one may follow.
        while (
            self.waiting
            and not self.stopping
            and (self.limit is None or len(self.running) < self.limit)
        ):
            self.start(self.waiting.popleft())

    def fail(self, error: BaseException) -> None:
        """End ``serve()`` with ``error`` once every task is cancelled (the first error wins)."""
        if self.error is None:
            self.error = error
        self.stopping = True
        self.waiting.clear()
        self.stop_all()

    async def dispatch(self) -> None:
        """Take CALL and CANCEL frames until the supervisor closes the channel."""
        try:
            while True:
                kind, item = await self._next_request(bool(self.running))
                if kind == Link.CANCEL:
                    assert isinstance(item, int)
                    self.cancel(item)
                else:
                    assert not isinstance(item, int)
                    self.take(item)
                # Not held while the next request is awaited: a mapped argument
                # lives as long as the handler keeps it, no longer.
                del item
        except EOFError:
            return
        except Exception as exc:  # the channel broke or was closed: serve() raises it as it is
            self.fail(exc)

    @staticmethod
    async def outcome(pending: Any) -> tuple[bool, Any]:
        """``(ok, value or what it raised)`` of an ``async def`` method's coroutine."""
        try:
            return True, await pending
        except Exception as exc:
            return False, from_fn(exc)

    def answer_now(self, call_id: int, ok: bool, value: Any) -> None:
        """Queue the answer and write what the socket takes; a task writes the rest."""
        frames = self.frames
        try:
            frames.queue_packed(Link.REPLY, reply(call_id, ok, value, frames.shares_memory))
            if frames.write_some():
                return
        except Exception as exc:  # the channel broke, or was closed, under the call
            self.fail(exc)
            return
        self.spawn(self.flush())

    async def flush(self) -> None:
        """Write what is queued; the frames go out whole even if this is cancelled."""
        try:
            await self._flush()
        except Exception as exc:  # the channel broke, or was closed, under the call
            self.fail(exc)


def _cancelled(exc: BaseException, cancelled: type[BaseException]) -> bool:
    """True if ``exc`` is a cancellation, or a group of nothing else (a handler's nursery)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(cancelled)[1] is None
    return isinstance(exc, cancelled)


def _unset(*args: Any) -> Any:
    raise AssertionError("set by serve_asyncio() or serve_trio()")


def _close(awaitable: Any) -> None:
    """Close a coroutine that will never run (no "never awaited" warning)."""
    close = getattr(awaitable, "close", None)
    if close is not None:
        close()


async def serve_asyncio(calls: Calls) -> None:
    """:class:`Calls` on asyncio (uvloop too): a task per call in one ``asyncio.TaskGroup``."""
    import asyncio

    serving = asyncio.current_task()
    assert serving is not None
    tasks: set[asyncio.Task[None]] = set()

    async def run(call_id: int, pending: Any) -> None:
        try:
            ok, value = await calls.outcome(pending)
        except asyncio.CancelledError as exc:
            if call_id in calls.cancelled or calls.stopping:
                return  # asked for (a CANCEL, or serve() ending): nobody waits for an answer
            if serving.cancelling():
                calls.stopping = True
                raise  # serve() is cancelled: the task group goes on with it
            calls.fail(exc)  # the handler's own: ends serve(), as any BaseException
            return
        except BaseException as exc:  # SystemExit, KeyboardInterrupt
            calls.fail(exc)
            return
        finally:
            calls.ended(call_id)
            _close(pending)  # never started, if cancelled at once
        frames = calls.frames
        try:
            frames.queue_packed(Link.REPLY, reply(call_id, ok, value, frames.shares_memory))
        except Exception as exc:  # the rank closed its channel under the call
            calls.fail(exc)
            return
        await calls.flush()

    async with asyncio.TaskGroup() as group:

        def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
            try:
                task = group.create_task(coro)
            except RuntimeError:  # the group is shutting down: serve() is cancelled
                coro.close()
                calls.stopping = True
                return None
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return task

        def run_call(call_id: int, pending: Any) -> Callable[[], object] | None:
            task = spawn(run(call_id, pending))
            if task is None:
                _close(pending)
                return None
            return task.cancel

        def stop_all() -> None:
            for task in tasks:
                task.cancel()

        calls.run_call, calls.spawn, calls.stop_all = run_call, spawn, stop_all
        spawn(calls.dispatch())
    if calls.error is not None:
        raise calls.error


async def serve_trio(calls: Calls) -> None:
    """:class:`Calls` on trio: a task per call, each in a cancel scope, in one nursery."""
    import trio

    async def run(call_id: int, pending: Any, scope: trio.CancelScope) -> None:
        try:
            with scope:
                # A call started as serve() ends (a task ended meanwhile) must
                # not run its method's code before its first checkpoint.
                await trio.lowlevel.checkpoint_if_cancelled()
                ok, value = await calls.outcome(pending)
        except BaseException as exc:
            if _cancelled(exc, trio.Cancelled):
                calls.stopping = True
                raise  # serve() is cancelled, or ends: the nursery goes on with it
            calls.fail(exc)  # SystemExit, KeyboardInterrupt: ends serve()
            return
        finally:
            calls.ended(call_id)
            _close(pending)  # never started, if cancelled at once
        if scope.cancelled_caught:
            return  # a CANCEL: nobody waits for an answer
        frames = calls.frames
        try:
            frames.queue_packed(Link.REPLY, reply(call_id, ok, value, frames.shares_memory))
        except Exception as exc:  # the rank closed its channel under the call
            calls.fail(exc)
            return
        await calls.flush()

    async with trio.open_nursery() as nursery:

        def run_call(call_id: int, pending: Any) -> Callable[[], object]:
            scope = trio.CancelScope()
            nursery.start_soon(run, call_id, pending, scope)
            return scope.cancel

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            async def run_it() -> None:
                await coro

            nursery.start_soon(run_it)

        calls.run_call, calls.spawn = run_call, spawn
        calls.stop_all = nursery.cancel_scope.cancel
        nursery.start_soon(calls.dispatch)
    if calls.error is not None:
        raise calls.error
