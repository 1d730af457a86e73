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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import pytest

import aiospawn.sync as sync
from aiospawn import AsyncProcessContext
from aiospawn._sync import _blocking_group, _portal
from tests import interrupt_ranks, ranks
from tests.fake_backend import FakeBackend, start_group
from tests.helpers import is_gone, live_children, wait_until


def loop_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "aiospawn-sync-loop"]


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, even where pytest runs with SIGINT ignored."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def place(frame: FrameType, event: str) -> str:
    """An event and where it happened: ``"line _join (/path/sync.py:123)"``."""
    code = frame.f_code
    return f"{event} {code.co_name} ({code.co_filename}:{frame.f_lineno})"


class InterruptAt:
    """A trace function that raises KeyboardInterrupt at one traced event.

    Counts the ``call``, ``line`` and ``return`` events of the thread it is
    set on (``sys.settrace``) and raises at the ``k``-th, or at the first that
    happens at ``at`` (a :func:`place`); raising from a trace function also
    ends the tracing, so exactly one interruption happens per run. With
    neither, it records every event's place in :attr:`seen`.
    """

    def __init__(self, k: int | None = None, at: str | None = None) -> None:
        self.k = k
        self.at = at
        self.events = 0
        self.seen: list[str] = []
        self.hit: str | None = None
        self.interruption = KeyboardInterrupt()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> InterruptAt:
        if event in ("call", "line", "return"):
            self.events += 1
            where = place(frame, event)
            if self.events == self.k or where == self.at:
                self.hit = where
                raise self.interruption
            if self.k is None and self.at is None:
                self.seen.append(where)
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


class RealGroup:
    """One rank under ``start_method`` that reports, then waits until the handshake releases it."""

    def __init__(self, start_method: str) -> None:
        self.start_method = start_method
        self.children = live_children()
        # Made before the tracing starts: only aiospawn.sync's call is interrupted.
        self.handshake = Handshake.open(nprocs=1)

    def start_and_join(self) -> None:
        sync.start_processes(
            interrupt_ranks.report_then_wait,
            (self.handshake.report, self.handshake.release),
            nprocs=1,
            start_method=self.start_method,
        )

    def close(self) -> None:
        self.handshake.close()

    def left_running(self) -> list[str]:
        return [f"process {pid}" for pid in sorted(live_children() - self.children)]


class FakeGroup:
    """One fake rank (tests/fake_backend.py) that returns by itself a moment after it starts.

    The caller's thread, the one traced, runs the same code of ``aiospawn.sync``
    as for a real group; the group it drives on the loop thread has no process.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.backend = FakeBackend()
        self.backend.runs_for = 0.005

        async def start_fake(*args: object, **kwargs: object) -> AsyncProcessContext[Any]:
            return await start_group(self.backend, nprocs=1)

        monkeypatch.setattr(_blocking_group, "_start_group_async", start_fake)

    def start_and_join(self) -> None:
        sync.start_processes(interrupt_ranks.report_then_wait, nprocs=1, start_method="fork")

    def close(self) -> None:
        pass

    def left_running(self) -> list[str]:
        return [
            f"fake rank {made.rank}"
            for made in self.backend.made
            if made.started and made.exit is None
        ]


def run_interrupted(trace: InterruptAt, group: RealGroup | FakeGroup) -> InterruptAt:
    """Start and join a group under ``trace``; check what is left."""
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
        group.start_and_join()
    except BaseException as exc:
        raised = exc
    finally:
        sys.settrace(None)
        sys.unraisablehook = previous_hook
        gc.enable()
        group.close()
    where = f"interrupted at event {trace.events}: {trace.hit}"
    if trace.hit is None:
        assert raised is None, f"the run that was not interrupted raised {raised!r}"
    elif swallowed:  # in a finalizer or weakref callback: the run went on undisturbed
        assert raised is None, f"{where} (swallowed there): raised {raised!r}"
    else:
        assert type(raised) is KeyboardInterrupt, f"{where}: raised {raised!r}"
    # At once, no retry: the ranks were reaped and the loop thread was gone
    # before the exception left.
    assert group.left_running() == [], f"{where}: ranks left running"
    assert loop_threads() == [], f"{where}: the loop thread was left running"
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        # Interrupted while it put Python's handler back: the one left in
        # place acts as Python's, and puts it back, on the next Ctrl-C.
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
    return trace


def sweep(new_group: Callable[[], RealGroup | FakeGroup]) -> None:
    """Interrupt a start and join at each traced event in turn, the first, the second..."""
    k = 1
    while run_interrupted(InterruptAt(k), new_group()).hit is not None:
        k += 1
    assert k > 100  # the last run had fewer events than this: it ran to its end


def places(new_group: Callable[[], RealGroup | FakeGroup]) -> list[str]:
    """The places of a start and join's events, uninterrupted, each once, in order."""
    trace = run_interrupted(InterruptAt(), new_group())
    return list(dict.fromkeys(trace.seen))


#: Where aiospawn.sync's own code is: the module, and the package of its machinery.
SYNC_CODE = (f"{os.sep}aiospawn{os.sep}sync.py:", f"{os.sep}aiospawn{os.sep}_sync{os.sep}")


def in_sync(places: Iterable[str]) -> set[str]:
    """The places of ``places`` in aiospawn.sync's own code."""
    return {place for place in places if any(code in place for code in SYNC_CODE)}


@contextmanager
def fake_groups() -> Iterator[Callable[[], FakeGroup]]:
    with pytest.MonkeyPatch.context() as patch:
        yield lambda: FakeGroup(patch)


# A tripwire, not a bound: about 900 whole starts and joins, 10-25 s alone,
# and past the default 120 s in a full suite whose worker had imported torch
# (every garbage collection then walks torch's objects too).
@pytest.mark.timeout(600)
def test_an_interruption_at_any_point_of_a_start_and_join_leaves_nothing() -> None:
    # Against a fake group: the caller's thread, the one interrupted, runs the
    # same code whatever runs the ranks (the slow test below checks it). Each
    # event in turn, as in the real sweeps; then the first event at each place,
    # which a run whose waits loop more or fewer times might step over.
    with fake_groups() as new_group:
        sweep(new_group)
        for where in places(new_group):
            hit = run_interrupted(InterruptAt(at=where), new_group()).hit
            # Our own code passes every place on every run. A place in asyncio's
            # or anyio's may depend on how the threads interleave (asyncio's
            # _write_to_self runs only when the loop thread needs waking): seen
            # in the first run, it may not come in this one, which must then
            # leave nothing all the same (run_interrupted checks that).
            assert hit == where or (hit is None and not in_sync([where])), (where, hit)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_an_interruption_at_any_point_of_a_real_start_and_join_leaves_nothing(
    start_method: str,
) -> None:
    # The first event at each place of aiospawn.sync's own code that a real
    # start and join pass through (about 180, against about 650 events).
    real = places(lambda: RealGroup(start_method))
    for where in real:
        if where in in_sync(real):
            assert run_interrupted(InterruptAt(at=where), RealGroup(start_method)).hit == where
    # What the fake sweep stands for: a real group's start and join pass
    # through no place of aiospawn.sync that a fake group's do not.
    with fake_groups() as new_group:
        fake = in_sync(places(new_group))
    assert in_sync(real) - fake == set()


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

    monkeypatch.setattr(_portal.LoopThread, "_execute", die)
    with pytest.raises(RuntimeError, match="event loop thread ended") as info:
        sync.start_processes(ranks.sleep_forever, nprocs=1, start_method="fork")
    assert loop_threads() == []
    assert isinstance(info.value.__cause__, BaseException)


def test_a_second_ctrl_c_during_the_shutdown_raises_at_once_and_kills_the_ranks(
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
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ctx.join(grace_period=60)
        # Out at once, and the rank, which ignores SIGTERM, is killed now
        # rather than when the 60 s grace period ends.
        (pid,) = ctx.pids()
        assert wait_until(lambda: is_gone(pid), 20)
        assert time.monotonic() - began < 30
    finally:
        presser.join()
    with pytest.raises(sync.ProcessExitedException, match="SIGKILL"):
        ctx.join()
    assert loop_threads() == []
