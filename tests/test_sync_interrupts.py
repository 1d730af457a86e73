"""Ctrl-C in aiospawn.sync: wherever it lands, the group is stopped and reaped.

The caller's thread can be interrupted at any bytecode (a ``KeyboardInterrupt``
raised by a signal handler, or by anything else). The sweep raises one at
every line, call and return the calling thread traces while a group starts
and is joined, under each start method, and checks what is left: nothing
(no rank, no loop thread), with ``KeyboardInterrupt`` as the exception.
Real Ctrl-C goes through the handler that ``aiospawn.sync`` puts in place
meanwhile: it is counted, the group is shut down, and ``KeyboardInterrupt``
is raised at one point, after the reap.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import psutil
import pytest

import aiospawn.sync as sync
from tests import interrupt_ranks, ranks
from tests.conftest import live_children


def loop_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "aiospawn-sync-loop"]


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, even where pytest runs with SIGINT ignored."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class InterruptAt:
    """A trace function that raises KeyboardInterrupt at the ``k``-th traced event.

    Counts the ``call``, ``line`` and ``return`` events of the thread it is
    set on (``sys.settrace``); raising from a trace function also ends the
    tracing, so exactly one interruption happens per run.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.events = 0
        self.hit: str | None = None
        self.interruption = KeyboardInterrupt()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> InterruptAt:
        if event in ("call", "line", "return"):
            self.events += 1
            if self.events == self.k:
                code = frame.f_code
                self.hit = f"{event} {code.co_name} ({code.co_filename}:{frame.f_lineno})"
                raise self.interruption
        return self


@dataclass
class Handshake:
    """Ranks report on ``ready``; a helper thread releases them all once they have."""

    nprocs: int
    ready: Connection
    report: Connection
    release: Connection
    go: Connection
    stop: threading.Event
    helper: threading.Thread

    @classmethod
    def open(cls, nprocs: int) -> Handshake:
        ready, report = multiprocessing.Pipe(duplex=False)
        release, go = multiprocessing.Pipe(duplex=False)
        stop = threading.Event()
        helper = threading.Thread(target=lambda: None)
        handshake = cls(nprocs, ready, report, release, go, stop, helper)
        handshake.helper = threading.Thread(target=handshake._release_when_ready)
        handshake.helper.start()
        return handshake

    def _release_when_ready(self) -> None:
        reported = 0
        while reported < self.nprocs and not self.stop.is_set():
            if self.ready.poll(0.01):
                self.ready.recv()
                reported += 1
        self.go.send(None)

    def close(self) -> None:
        self.stop.set()
        self.helper.join()
        for end in (self.ready, self.report, self.release, self.go):
            end.close()


def run_interrupted_at(k: int, start_method: str, children: set[int]) -> InterruptAt:
    """Start and join a group, interrupted at the ``k``-th event; check what is left."""
    handshake = Handshake.open(nprocs=1)
    trace = InterruptAt(k)
    raised: BaseException | None = None
    # The interpreter swallows an exception raised in a weakref callback or a
    # finalizer (it reports it as unraisable), and the collector runs those
    # in whichever thread allocates at that moment: not this thread, here.
    gc.collect()
    gc.disable()
    # Without the collector, they still run where an object's last reference
    # goes, which may be this thread (the loop thread's event loop, say, or a
    # WeakSet's entry): the interruption raised there goes no further.
    swallowed = False
    previous_hook = sys.unraisablehook

    def unraisable_hook(unraisable: Any) -> None:
        nonlocal swallowed
        if unraisable.exc_value is trace.interruption:
            swallowed = True
        else:
            previous_hook(unraisable)

    sys.unraisablehook = unraisable_hook
    sys.settrace(trace)
    try:
        sync.start_processes(
            interrupt_ranks.report_then_wait,
            (handshake.report, handshake.release),
            nprocs=1,
            start_method=start_method,
        )
    except BaseException as exc:
        raised = exc
    finally:
        sys.settrace(None)
        sys.unraisablehook = previous_hook
        gc.enable()
        handshake.close()
    where = f"interrupted at event {k}: {trace.hit}"
    if trace.hit is None:
        assert raised is None, f"the run that was not interrupted raised {raised!r}"
    elif swallowed:  # in a finalizer or weakref callback: the run went on undisturbed
        assert raised is None, f"{where} (swallowed there): raised {raised!r}"
    else:
        assert type(raised) is KeyboardInterrupt, f"{where}: raised {raised!r}"
    # At once, no retry: the ranks were reaped and the loop thread was gone
    # before the exception left.
    assert live_children() <= children, f"{where}: ranks left running"
    assert loop_threads() == [], f"{where}: the loop thread was left running"
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        # Interrupted while it put Python's handler back: the one left in
        # place acts as Python's, and puts it back, on the next Ctrl-C.
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
    return trace


def sweep(start_method: str) -> None:
    children = live_children()
    k = 1
    while run_interrupted_at(k, start_method, children).hit is not None:
        k += 1
    assert k > 100  # the last run had fewer events than this: it ran to its end


@pytest.mark.timeout(900)
def test_an_interruption_at_any_point_of_a_fork_start_and_join_leaves_nothing() -> None:
    sweep("fork")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_an_interruption_at_any_point_of_a_start_and_join_leaves_nothing(
    start_method: str,
) -> None:
    sweep(start_method)


def test_a_ctrl_c_taken_by_another_thread_still_stops_the_group() -> None:
    # A signal sent to the process may be taken by any thread that does not
    # block it; then only a flag is set, and the main thread runs the handler
    # when it next wakes up. So it must wake up: this is the Ctrl-C that
    # lands just as the main thread goes to sleep, made deterministic.
    ready = multiprocessing.get_context("fork").SimpleQueue()
    pids: list[int] = []
    done = threading.Event()
    tripped: list[str] = []

    def interrupt_from_here() -> None:
        for _ in range(2):
            pids.append(ready.get()[1])
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        if not done.wait(30):  # the tripwire: end the ranks, so that the call can end
            tripped.append("deadlock: the main thread slept on through a Ctrl-C")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)

    interrupter = threading.Thread(target=interrupt_from_here)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sync.start_processes(ranks.report_ready, (ready,), nprocs=2, start_method="fork")
    finally:
        done.set()
        interrupter.join()
    assert tripped == []
    assert len(pids) == 2
    assert live_children().isdisjoint(pids)
    assert loop_threads() == []


def test_a_loop_thread_that_dies_fails_the_waiting_call_instead_of_stranding_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def die(self: object, call: object) -> None:
        raise SystemExit("the loop thread dies")  # asyncio lets it end the loop

    monkeypatch.setattr(sync._LoopThread, "_execute", die)
    with pytest.raises(RuntimeError, match="event loop thread ended") as info:
        sync.start_processes(ranks.sleep_forever, nprocs=1, start_method="fork")
    assert loop_threads() == []
    assert isinstance(info.value.__cause__, BaseException)


def test_a_second_ctrl_c_during_the_shutdown_raises_at_once_and_join_reports_it(
    events: tuple[Connection, Connection],
) -> None:
    reader, writer = events
    ctx = sync.start_processes(
        ranks.api_record_sigterm, (writer, True), nprocs=1, join=False, start_method="fork"
    )
    main = threading.main_thread().ident
    assert main is not None
    joining = threading.Event()

    def press_ctrl_c_twice() -> None:
        kind, _, _ = reader.recv()
        assert kind == "ready"
        joining.wait()
        # join() puts its own handler in place as it starts waiting.
        deadline = time.monotonic() + 10
        while signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            if time.monotonic() > deadline:
                break  # no handler of its own: interrupt it as it is
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)  # the group starts to shut down
        assert reader.recv() == ("SIGTERM", 0)  # which the rank ignores
        signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c_twice)
    presser.start()
    try:
        joining.set()
        with pytest.raises(KeyboardInterrupt):
            ctx.join(grace_period=60)
        # Out before the shutdown's SIGKILL, 60 s away: the rank still runs.
        (pid,) = ctx.pids()
        assert psutil.pid_exists(pid)
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    finally:
        presser.join()
        ctx.terminate(grace_period=0)  # hurries the shutdown under way
    with pytest.raises(sync.ProcessExitedException, match="SIGKILL"):
        ctx.join()
    assert loop_threads() == []
