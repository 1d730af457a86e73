"""A fake backend: rank handles the test drives, no processes (as httpx's ``MockTransport``).

The group's supervision talks to ranks only through the backend seam
(``aiospawn._core._backend``). :class:`FakeBackend` implements it with
:class:`FakeRank` handles whose life the test decides: when a start fails,
when a rank beats, how and when it exits, whether it obeys SIGTERM. Exits are
noticed as a real rank's are: by the rank's watcher or a ``poll()``, not when
the test declares them. Time is a :class:`FakeClock` the test moves.

    backend = FakeBackend()
    clock = FakeClock()
    ctx = await start_group(backend, nprocs=2, clock=clock, restart=policy)
    backend.attempt(1).raises(ValueError("boom"))
    with pytest.raises(aiospawn.ProcessRaisedException):
        await ctx.join()
"""

from __future__ import annotations

import pickle
import signal
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._backend import OnExit, RankHandle, raise_start_error
from aiospawn._core._capture import CaptureBuffer
from aiospawn._core._concurrency import Broadcast
from aiospawn._core._context import AsyncProcessContext
from aiospawn._core._outcome import RankExit
from aiospawn._core._policy import RestartPolicy, Supervision
from aiospawn._core._spec import DEFAULT_PREFIX, LaunchSpec, make_output_spec, make_spec
from aiospawn._rank.wire import Kind, encode_exception


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds``."""
        self.now += seconds


class FakeRank:
    """One attempt at one rank; it starts, beats and exits when the test says."""

    def __init__(self, backend: FakeBackend, index: int, restart: int, on_exit: OnExit) -> None:
        self._backend = backend
        self.rank = index
        self.restart = restart
        self.link = None  # no channel
        self._on_exit = on_exit
        self.started = False
        self.pid: int | None = None
        self.exit: RankExit | None = None
        self.discarded = False
        self.signals: list[int] = []
        self.beat: float | None = None
        self.stack_text: str | None = f"stack of rank {index}"
        self._ending: tuple[int, tuple[int, bytes] | None, float | None] | None = None
        self._ended = anyio.Event()
        self._stopped_by_us = False

    @property
    def process(self) -> None:
        """No process object: nothing runs."""
        return None

    # The seam (RankHandle), as the group calls it.

    def poll(self) -> RankExit | None:
        """Record the exit the test declared, as a watcher reaping the rank would."""
        if self.exit is None and self._ending is not None:
            assert self.pid is not None
            exit_code, frame, ended_at = self._ending
            self.exit = RankExit(
                rank=self.rank,
                pid=self.pid,
                exit_code=exit_code,
                frame=frame,
                stopped_by_us=self._stopped_by_us,
                ended_at=ended_at,
            )
            self._on_exit(self.exit)
            self._backend.changed.notify()
        return self.exit

    async def wait(self) -> RankExit:
        """Wait until the test ends the rank (or a signal does)."""
        await self._ended.wait()
        await checkpoint()
        exit = self.poll()
        assert exit is not None
        return exit

    def discard(self) -> None:
        """Note that the group released an attempt that never started."""
        self.discarded = True

    def send_signal(self, signum: int) -> bool:
        """Record ``signum``; the rank dies of it unless the backend says it ignores it."""
        if not self.started or self.poll() is not None:
            return False
        self._stopped_by_us = True
        self.signals.append(signum)
        if signum == signal.SIGKILL or signum not in self._backend.ignored_signals:
            self._end(-signum, None)
        return True

    def last_beat(self) -> float | None:
        """The fake clock's time of the last :meth:`heartbeat`."""
        return self.beat

    async def stack(self, patience: float) -> str | None:
        """The stack text the test set (``stack_text``)."""
        await checkpoint()
        return self.stack_text

    # What the test does to the rank.

    def heartbeat(self) -> None:
        """The rank calls ``aiospawn.heartbeat()`` now (on the backend's clock)."""
        self.beat = self._backend.clock()

    def returns(self, value: Any = None) -> None:
        """``fn`` returns ``value`` and the process exits 0."""
        self._end(0, (Kind.RETURNED, pickle.dumps(value)))

    def raises(self, exc: BaseException, at: float | None = None) -> None:
        """``fn`` raises ``exc`` (at ``time.time()`` ``at``, if given) and the process exits 1."""
        text = f"Traceback (most recent call last):\n  fake\n{type(exc).__name__}: {exc}\n"
        self._end(1, (Kind.RAISED, encode_exception(exc, text)), at)

    def exits(self, exit_code: int) -> None:
        """The process ends with ``exit_code`` (negative: killed by that signal), no frame."""
        self._end(exit_code, None)

    def _end(
        self, exit_code: int, frame: tuple[int, bytes] | None, at: float | None = None
    ) -> None:
        assert self.started, f"rank {self.rank} attempt {self.restart} has not started"
        if self._ending is None:
            self._ending = (exit_code, frame, at)
            self._ended.set()


class FakeLauncher:
    """The launcher of one group on the fake backend."""

    def __init__(self, backend: FakeBackend, spec: LaunchSpec) -> None:
        self._backend = backend
        self.spec = spec
        self.rendezvous = 0
        self.closed = False

    def make_rank(self, index: int, restart: int, on_exit: OnExit) -> FakeRank:
        """Make attempt ``restart`` of rank ``index``, recorded in the backend."""
        rank = FakeRank(self._backend, index, restart, on_exit)
        self._backend.made.append(rank)
        return rank

    async def start(self, ranks: Sequence[RankHandle]) -> None:
        """Start ``ranks``; those the backend's ``fail_start`` names fail with its error."""
        errors: dict[int, BaseException] = {}
        for rank in ranks:
            assert isinstance(rank, FakeRank)
            await checkpoint()
            error = self._backend.fail_start.pop((rank.rank, rank.restart), None)
            if error is not None:
                errors[rank.rank] = error
                rank.discard()
                continue
            self._backend.next_pid += 1
            rank.pid = self._backend.next_pid
            rank.started = True
        self._backend.changed.notify()
        raise_start_error(errors, len(ranks))

    def new_rendezvous(self) -> None:
        """Count the fresh rendezvous a whole-group restart asks for."""
        self.rendezvous += 1

    async def aclose(self) -> None:
        """Record that the group released its launcher."""
        await checkpoint()
        self.closed = True


class FakeBackend:
    """A backend of :class:`FakeRank` handles, with the test's controls.

    Attributes:
        clock: The group's clock (pass it to :func:`start_group`).
        made: Every attempt made, in order.
        fail_start: ``(rank, attempt) -> error`` for starts that must fail.
        ignored_signals: Signals the ranks survive (SIGKILL never is).
        changed: Notified whenever a rank starts or exits.
    """

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.made: list[FakeRank] = []
        self.fail_start: dict[tuple[int, int], BaseException] = {}
        self.ignored_signals: set[int] = set()
        self.changed = Broadcast()
        self.next_pid = 10_000
        self.launcher: FakeLauncher | None = None

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> FakeLauncher:
        """Make the group's launcher; nothing starts yet."""
        await checkpoint()
        self.launcher = FakeLauncher(self, spec)
        return self.launcher

    def attempt(self, rank: int, restart: int | None = None) -> FakeRank:
        """Attempt ``restart`` at ``rank`` (the latest made, by default)."""
        attempts = [made for made in self.made if made.rank == rank]
        if restart is None:
            return attempts[-1]
        [found] = [made for made in attempts if made.restart == restart]
        return found

    async def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait (at most 10 s: a deadlock tripwire) until ``predicate()`` holds."""
        try:
            with anyio.fail_after(10):
                while not predicate():
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"deadlock: {what} did not happen") from None

    async def started(self, rank: int, restart: int) -> FakeRank:
        """Wait until attempt ``restart`` at ``rank`` has started; return it."""

        def running() -> bool:
            return any(m.rank == rank and m.restart == restart and m.started for m in self.made)

        await self.wait_until(running, f"the start of rank {rank} attempt {restart}")
        return self.attempt(rank, restart)


async def start_group(
    backend: FakeBackend,
    nprocs: int = 2,
    *,
    grace_period: float | None = None,
    restart: RestartPolicy | None = None,
    heartbeat_timeout: float | None = None,
    startup_timeout: float | None = None,
) -> AsyncProcessContext[Any]:
    """Start a group of ``nprocs`` fake ranks, supervised on the backend's clock."""
    output = make_output_spec("inherit", "inherit", False, DEFAULT_PREFIX)
    spec = make_spec(
        _never_called, (), nprocs, "fork", False, output=output, check_importable=False
    )
    supervision = Supervision(
        grace_period=grace_period,
        restart=restart,
        heartbeat_timeout=heartbeat_timeout,
        startup_timeout=startup_timeout,
        clock=backend.clock,
    )
    return await AsyncProcessContext._start(spec, supervision, backend)


def _never_called(rank: int) -> None:
    raise AssertionError("a fake rank runs nothing")
