"""An event loop on a private daemon thread, and blocking calls into it.

The portal between a blocking caller and the async core: ``LoopThread.run``
hands a coroutine function to the loop thread and sleeps until it has ended,
and neither side ever waits inside ``threading`` or ``concurrent.futures``,
where an exception in the caller (a Ctrl-C) can leave a lock held or a
thread marked stopped. Whatever point an exception hits in the caller, the
loop thread can still finish every call and end::

    caller thread                          loop thread "aiospawn-sync-loop" (daemon)
    ─────────────                          ─────────────────────────────────────────
    run(fn, *args): a Call in the set ───► LoopThread._serve: a task per new Call
      poke the loop (never blocks)         fn(*args) in the Call's cancel scope
      sleep on the Call's Latch              │
        in POLL_SECONDS steps, so that a     │
        signal's handler always gets to run  │
      an exception or a first Ctrl-C:        │
        Call.cancel, poke ─────────────────► └ the scope cancelled
      result, error or KeyboardInterrupt ◄── the Call finished, its Latch set
    close(): wait for the thread's end ◄──── no calls left once stopping: the loop ends

If the loop thread dies, every call still waiting on it fails with
:func:`loop_died`'s error; a call made once the loop has ended fails with
:class:`LoopClosed`.

Imports the standard library, anyio, and ``_interrupts`` (the Ctrl-C that a
wait turns into a cancellation).
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import anyio

from ._interrupts import CtrlC

T = TypeVar("T")

#: The name of every loop thread.
LOOP_THREAD_NAME = "aiospawn-sync-loop"


class LoopClosed(Exception):
    """The loop thread has ended (by another thread's call): it takes no more calls."""


#: How long a blocked caller sleeps at a time. CPython runs a signal handler
#: in the main thread only between bytecodes or when a wait returns EINTR; a
#: signal that lands just before the thread goes to sleep only sets a flag, so
#: an unbounded sleep could outlast a Ctrl-C for as long as the ranks run.
POLL_SECONDS = 0.05


class Latch:
    """A flag set once by one thread and waited for by another, in short sleeps.

    Neither side ever blocks inside ``threading``'s Condition or Event code,
    where an exception (a Ctrl-C in the waiter) can leave a lock held, and
    ``set()`` never blocks at all.
    """

    __slots__ = ("_lock", "is_set")

    def __init__(self) -> None:
        self.is_set = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        """Set the flag and wake the waiter; never blocks, and a second call does nothing."""
        if not self.is_set:
            self.is_set = True
            self._lock.release()

    def wait(self, poll: Callable[[], object] | None = None) -> None:
        """Return once the flag is set, calling ``poll()`` before each short sleep."""
        # The flag, not the lock, says whether it is set: an exception right
        # after a successful acquire must not make the next wait sleep forever.
        while not self.is_set:
            if poll is not None:
                poll()
            self._lock.acquire(timeout=POLL_SECONDS)


class Call:
    """One coroutine function run on the loop thread for a blocking caller."""

    __slots__ = ("args", "begun", "cancel", "done", "error", "fn", "result", "scope")

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.begun = False  # loop thread: a task runs it
        self.cancel = False  # caller: stop it
        self.scope: anyio.CancelScope | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = Latch()

    def finish(self, result: Any, error: BaseException | None) -> None:
        """Record how the call ended and wake its caller; only the first finish counts."""
        if not self.done.is_set:
            self.result, self.error = result, error
            self.done.set()


class LoopThread:
    """An asyncio event loop on a private daemon thread, and the calls it runs for callers.

    Not ``anyio.from_thread.start_blocking_portal``: its thread belongs to a
    ``ThreadPoolExecutor``, which the interpreter joins at exit, so a group
    left running would hang the exit; and its hand-offs wait inside
    ``concurrent.futures.Future``, whose Condition an exception in the caller
    can leave locked. Here a caller only ever adds a call to a set, pokes the
    loop with ``call_soon_threadsafe`` (which never blocks) and sleeps on its
    own :class:`Latch`; whatever point an exception hits in the caller, the
    loop thread can still finish every call and end.

    The thread starts with the first call. A raw ``_thread`` starts it and
    then waits for its end: ``Thread.start()`` and ``Thread.join()`` wait in
    ``threading`` internals that an exception in the caller can break (a lock
    left held, or a live thread marked stopped, bpo-45274), so the caller
    does neither. If the loop thread dies, every call still waiting finishes
    with the reason, and nobody waits forever.

    Args:
        prepare: Called first on the loop thread, in the context that every
            task of the loop (and every worker thread it starts) inherits.
    """

    def __init__(self, prepare: Callable[[], object] | None = None) -> None:
        self._prepare = prepare
        self._calls: set[Call] = set()  # submitted and not finished
        self._spawned = 0  # the starter's thread id, once it runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nudged: asyncio.Event | None = None
        self._stopping = False  # close() was called: end once the calls are done
        self._closing = False  # the loop takes no more calls
        self._ended = Latch()  # the loop thread has gone
        self._failure: BaseException | None = None

    def run(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        interruptible: bool = True,
        then_stop: bool = False,
    ) -> T:
        """Run ``fn(*args)`` on the loop and wait for its result.

        If the wait is interrupted (an exception in this thread, or with
        ``interruptible`` a first Ctrl-C counted by :class:`CtrlC`), ``fn`` is
        cancelled and the exception (``KeyboardInterrupt`` for a Ctrl-C)
        propagates once ``fn`` has ended: for a group, the core's cancellation
        shuts it down and reaps it first. A further exception while that
        wait goes on (a second Ctrl-C) propagates at once, and ``fn`` ends on
        the loop by itself.

        Args:
            fn: A coroutine function.
            *args: Its arguments.
            interruptible: False for calls that clean up after an
                interruption: a Ctrl-C does not cancel them, and an
                exception propagates at once without cancelling them.
            then_stop: End the loop thread after this call (see :meth:`close`).

        Returns:
            What ``fn(*args)`` returned.

        Raises:
            LoopClosed: The loop thread had ended (or was ending) already.
            RuntimeError: The loop thread died while the call waited
                (:func:`loop_died`).
            KeyboardInterrupt: A first Ctrl-C came while it waited.
            BaseException: Whatever ``fn`` raised, or whatever interrupted
                the wait.
        """
        call = Call(fn, args)
        ctrl_c = CtrlC.current() if interruptible else None

        def on_ctrl_c() -> None:
            if ctrl_c is not None and ctrl_c.pending and not call.cancel:
                self._cancel(call)

        try:
            self._submit(call)
            if then_stop:  # only now: the loop cannot stop before it has seen the call
                self._stopping = True
            call.done.wait(on_ctrl_c)
        except BaseException:
            # The first interruption cancels the call and waits for its end
            # (the group shut down and reaped). A further one (a second
            # Ctrl-C), or one during a clean-up call, propagates at once and
            # leaves the call to finish on the loop.
            if interruptible and not call.cancel:
                self._cancel(call)
                call.done.wait()
            raise
        if ctrl_c is not None and ctrl_c.pending:
            ctrl_c.delivered = True
            raise KeyboardInterrupt
        if call.error is not None:
            raise call.error
        return cast("T", call.result)

    def start(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop without waiting; the loop thread then ends."""
        self._submit(Call(fn, args))
        self._stopping = True  # after the submission, as in run()

    def close(self) -> None:
        """End the loop once its calls have finished, and wait until its thread has gone."""
        self._stopping = True
        if not self._spawned:
            self._closing = True
            return
        self._nudge()
        self._ended.wait()

    def _submit(self, call: Call) -> None:
        self._calls.add(call)
        # Added before the check: the loop thread sets _closing before its
        # last look at the calls, so either it finishes this one, or we see
        # the flag.
        if self._closing:
            call.finish(None, LoopClosed())
            self._calls.discard(call)
            return
        if not self._spawned:
            self._spawned = _thread.start_new_thread(self._start_and_wait, ())
        else:
            self._nudge()

    def _cancel(self, call: Call) -> None:
        call.cancel = True
        # A call leaves the set only once finished, so one that is not in it
        # was never submitted (the caller was interrupted first).
        if not self._spawned or call not in self._calls:  # no loop thread will look at it
            call.finish(None, None)
            self._calls.discard(call)
        else:
            self._nudge()

    def _nudge(self) -> None:
        # Before the loop runs, there is nothing to poke: it looks at the
        # calls as soon as it does (it publishes itself first).
        loop, nudged = self._loop, self._nudged
        if loop is not None and nudged is not None:
            with contextlib.suppress(RuntimeError):  # closed: _start_and_wait finishes the calls
                loop.call_soon_threadsafe(nudged.set)

    def _start_and_wait(self) -> None:
        """The starter thread: start the loop thread, wait for its end, finish what is left."""
        try:
            thread = threading.Thread(target=self._main, name=LOOP_THREAD_NAME, daemon=True)
            thread.start()
            thread.join()
        except BaseException as exc:  # pragma: no cover - no thread could be started
            self._failure = exc
        finally:
            self._closing = True
            for call in list(self._calls):
                error = LoopClosed() if self._stopping else loop_died(self._failure)
                call.finish(None, error)
                self._calls.discard(call)
            self._ended.set()

    def _main(self) -> None:
        try:
            if self._prepare is not None:
                self._prepare()
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:
            self._failure = exc
        finally:
            self._closing = True

    async def _serve(self) -> None:
        nudged = asyncio.Event()
        async with anyio.create_task_group() as tasks:
            self._nudged = nudged
            self._loop = asyncio.get_running_loop()
            while True:
                for call in list(self._calls):
                    if call.done.is_set:  # cancelled before this thread began
                        self._calls.discard(call)
                    elif not call.begun:
                        call.begun = True
                        tasks.start_soon(self._execute, call)
                    elif call.cancel and call.scope is not None:
                        call.scope.cancel()
                if self._stopping and not self._calls:
                    break
                await nudged.wait()
                nudged.clear()

    async def _execute(self, call: Call) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                call.scope = scope
                if call.cancel:
                    scope.cancel()
                result = await call.fn(*call.args)
        except asyncio.CancelledError as exc:
            if _cancelled_from_outside():
                # Not the call's own scope (anyio uncancels the task for that
                # one): the loop is being torn down under the call, as asyncio
                # does when a callback raises SystemExit. Left in the set, the
                # call fails with the reason once the loop thread has ended.
                raise
            error = exc
        except BaseException as exc:  # the caller's to raise; never the loop's
            error = exc
        call.finish(result, error)
        self._calls.discard(call)  # after: see _cancel
        assert self._nudged is not None
        self._nudged.set()  # close() may be waiting for the last call


def _cancelled_from_outside() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def loop_died(failure: BaseException | None) -> RuntimeError:
    """The error of a call whose loop thread died under it (``failure`` is its cause)."""
    error = RuntimeError("aiospawn.sync's event loop thread ended while a call was waiting on it")
    error.__cause__ = failure
    return error
