"""The loop-thread portal alone: plain coroutine functions, no group, no process.

``aiospawn._sync._portal.LoopThread`` runs coroutine functions on a private
event loop thread for blocking callers. These tests prove its promises on
their own: a call returns its value or raises its error; a caller
interrupted while it waits cancels the call and gets the interruption only
once the call has ended (a second interruption gets out at once); the
thread ends when told to, and a thread that dies fails every waiting call
instead of stranding it.
"""

from __future__ import annotations

import _thread
import asyncio
import contextvars
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator

import anyio
import pytest

from aiospawn._sync._interrupts import with_ctrl_c_deferred
from aiospawn._sync._portal import LOOP_THREAD_NAME, LoopClosed, LoopThread

#: How long a test waits for what must happen before it calls it a deadlock.
TRIPWIRE = 30


def loop_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == LOOP_THREAD_NAME]


@pytest.fixture(autouse=True)
def no_loop_thread_left() -> Iterator[None]:
    assert loop_threads() == []
    yield
    for thread in loop_threads():
        thread.join(TRIPWIRE)
    assert loop_threads() == [], "a loop thread was left running"


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, even where pytest runs with SIGINT ignored."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def in_thread(fn: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


async def add(a: int, b: int) -> int:
    await anyio.lowlevel.checkpoint()
    return a + b


def test_a_call_returns_its_value_and_raises_its_error_on_the_loop_thread() -> None:
    loop = LoopThread()
    try:
        assert loop.run(add, 2, 3) == 5

        async def where() -> str:
            return threading.current_thread().name

        assert loop.run(where) == LOOP_THREAD_NAME
        error = ValueError("from the loop")

        async def fail() -> None:
            raise error

        with pytest.raises(ValueError, match="from the loop") as info:
            loop.run(fail)
        assert info.value is error
        # Even what would end a thread is the caller's to raise, not the loop's.
        with pytest.raises(SystemExit):
            loop.run(_raise_system_exit)
        assert loop.run(add, 1, 1) == 2
    finally:
        loop.close()
    assert loop_threads() == []


async def _raise_system_exit() -> None:
    raise SystemExit(3)


def test_calls_share_one_loop_thread_prepared_once_and_close_ends_it() -> None:
    prepared = contextvars.ContextVar("prepared", default="no")
    threads: list[int] = []

    def prepare() -> None:
        threads.append(threading.get_ident())
        prepared.set("yes")

    async def seen() -> tuple[str, int]:
        return prepared.get(), threading.get_ident()

    loop = LoopThread(prepare=prepare)
    first = loop.run(seen)
    second = loop.run(seen)
    assert first == second == ("yes", threads[0])
    assert len(threads) == 1
    (thread,) = loop_threads()
    assert thread.daemon
    loop.close()
    assert not thread.is_alive()  # close() returns once the thread has gone
    with pytest.raises(LoopClosed):
        loop.run(add, 1, 2)


def test_a_loop_closed_before_its_first_call_takes_none_and_starts_no_thread() -> None:
    loop = LoopThread()
    loop.close()
    with pytest.raises(LoopClosed):
        loop.run(add, 1, 2)
    assert loop_threads() == []


def test_then_stop_and_start_end_the_loop_thread_once_their_call_is_done() -> None:
    loop = LoopThread()
    assert loop.run(add, 1, 2, then_stop=True) == 3
    for thread in loop_threads():
        thread.join(TRIPWIRE)
        assert not thread.is_alive(), "then_stop left the loop thread running"
    loop.close()

    ran = threading.Event()

    async def record() -> None:
        ran.set()

    loop = LoopThread()
    loop.start(record)
    loop.close()  # waits for the started call, then for the thread's end
    assert ran.is_set()


@pytest.mark.usefixtures("default_sigint")
def test_an_exception_in_the_waiting_caller_cancels_the_call_and_waits_for_its_end() -> None:
    # Python's handler: the KeyboardInterrupt is raised inside the wait, as
    # any exception in the caller's thread would be.
    events: list[str] = []
    started = threading.Event()

    async def cleans_up_slowly() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            events.append("cancelled")
            with anyio.CancelScope(shield=True):
                # A clean-up that takes a while: the caller must wait it out.
                await anyio.sleep(0.2)
            events.append("cleaned up")

    loop = LoopThread()
    interrupter = in_thread(lambda: started.wait(TRIPWIRE) and _thread.interrupt_main())
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run(cleans_up_slowly)
        events.append("raised")
    finally:
        interrupter.join(TRIPWIRE)
        loop.close()
    assert events == ["cancelled", "cleaned up", "raised"]


@pytest.mark.usefixtures("default_sigint")
def test_a_first_ctrl_c_cancels_the_call_and_is_raised_once_the_call_has_ended() -> None:
    events: list[str] = []
    started = threading.Event()

    async def cleans_up_slowly() -> str:
        started.set()
        try:
            await anyio.sleep(TRIPWIRE)
            events.append("never cancelled")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.2)
            events.append("cleaned up")
        return "never"

    loop = LoopThread()
    # A Ctrl-C as the terminal sends it: the signal, handled by the main thread.
    interrupter = in_thread(lambda: started.wait(TRIPWIRE) and signal.raise_signal(signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            with_ctrl_c_deferred(lambda: loop.run(cleans_up_slowly))
        events.append("raised")
    finally:
        interrupter.join(TRIPWIRE)
        loop.close()
    assert events == ["cleaned up", "raised"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("default_sigint")
def test_a_second_ctrl_c_gets_out_at_once_and_the_call_still_ends_on_the_loop() -> None:
    started, cleaning, release = threading.Event(), threading.Event(), threading.Event()
    events: list[str] = []

    async def cleanup_held_until_released() -> None:
        started.set()
        try:
            await anyio.sleep(TRIPWIRE)
            events.append("never cancelled")
        finally:
            cleaning.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(release.wait, TRIPWIRE)
            events.append("cleaned up")

    def press_ctrl_c_twice() -> None:
        if started.wait(TRIPWIRE):
            signal.raise_signal(signal.SIGINT)
        if cleaning.wait(TRIPWIRE):
            signal.raise_signal(signal.SIGINT)

    loop = LoopThread()
    presser = in_thread(press_ctrl_c_twice)
    try:
        with pytest.raises(KeyboardInterrupt):
            with_ctrl_c_deferred(lambda: loop.run(cleanup_held_until_released))
        # Out while the clean-up is still held: it was not waited for.
        assert events == []
    finally:
        release.set()
        presser.join(TRIPWIRE)
        loop.close()  # the loop thread finished the call by itself
    assert events == ["cleaned up"]


@pytest.mark.usefixtures("default_sigint")
def test_an_uninterruptible_call_is_not_cancelled_by_a_ctrl_c() -> None:
    started, release = threading.Event(), threading.Event()

    async def waits_for_release() -> str:
        started.set()
        await anyio.to_thread.run_sync(release.wait, TRIPWIRE)
        return "done"

    def ctrl_c_then_release() -> None:
        if started.wait(TRIPWIRE):
            signal.raise_signal(signal.SIGINT)
        release.set()

    returned: list[str] = []
    loop = LoopThread()
    presser = in_thread(ctrl_c_then_release)
    try:
        with pytest.raises(KeyboardInterrupt):  # raised by the deferral, after the call
            with_ctrl_c_deferred(
                lambda: returned.append(loop.run(waits_for_release, interruptible=False))
            )
    finally:
        presser.join(TRIPWIRE)
        loop.close()
    assert returned == ["done"]


async def stop_the_loop() -> None:
    # run_until_complete then fails: "Event loop stopped before Future completed."
    asyncio.get_running_loop().stop()
    await anyio.sleep_forever()


async def exit_from_a_callback() -> None:
    # asyncio lets SystemExit from a callback end the loop, then cancels its tasks.
    asyncio.get_running_loop().call_soon(_raise_system_exit_now)
    await anyio.sleep_forever()


def _raise_system_exit_now() -> None:
    raise SystemExit("the loop thread dies")


@pytest.mark.parametrize(
    ("death", "cause"), [(stop_the_loop, RuntimeError), (exit_from_a_callback, SystemExit)]
)
def test_a_loop_thread_that_dies_under_a_call_fails_it_instead_of_stranding_it(
    death: Callable[[], Awaitable[None]], cause: type[BaseException]
) -> None:
    outcome: list[BaseException] = []
    loop = LoopThread()
    thread = in_thread(lambda: _run_into(loop, outcome, death))
    thread.join(TRIPWIRE)
    assert not thread.is_alive(), "the call was stranded on a dead loop thread"
    (error,) = outcome
    assert type(error) is RuntimeError, repr(error)
    assert "event loop thread ended while a call was waiting on it" in str(error)
    assert type(error.__cause__) is cause
    assert loop_threads() == []
    with pytest.raises(LoopClosed):  # and it takes no more calls
        loop.run(add, 1, 2)
    loop.close()


def test_a_loop_thread_that_cannot_start_its_loop_fails_the_first_call() -> None:
    def prepare() -> None:
        raise OSError("no loop here")

    loop = LoopThread(prepare=prepare)
    outcome: list[BaseException] = []
    thread = in_thread(lambda: _run_into(loop, outcome, add, 1, 2))
    thread.join(TRIPWIRE)
    assert not thread.is_alive(), "the call was stranded on a dead loop thread"
    (error,) = outcome
    assert isinstance(error, RuntimeError)
    assert isinstance(error.__cause__, OSError)
    loop.close()


def _run_into(
    loop: LoopThread, outcome: list[BaseException], fn: Callable[..., Awaitable[object]], *args: int
) -> None:
    try:
        loop.run(fn, *args)
    except BaseException as exc:
        outcome.append(exc)
