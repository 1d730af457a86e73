"""A fake backend: rank handles the test drives, no processes (as httpx's ``MockTransport``).

The group's supervision talks to ranks only through the backend seam
(``aiospawn._core._backend``). :class:`FakeBackend` implements it with
:class:`FakeRank` handles whose life the test decides: when a start fails,
when a rank beats, how and when it exits, whether it obeys SIGTERM. Exits are
noticed as a real rank's are: by the rank's watcher or a ``poll()``, not when
the test declares them. Time is a :class:`FakeClock` the test moves. With
``FakeBackend(links=True)`` each attempt has a :class:`MemoryLink`, a channel
in memory whose rank's end the test plays, so that messages, readiness and
calls run through the group's real channel code.

    backend = FakeBackend()
    clock = FakeClock()
    ctx = await start_group(backend, nprocs=2, clock=clock, restart=policy)
    backend.attempt(1).raises(ValueError("boom"))
    with pytest.raises(aiospawn.ProcessRaisedException):
        await ctx.join()
"""

from __future__ import annotations

import collections
import pickle
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._backend import RankHandle, raise_start_error
from aiospawn._core._capture import CaptureBuffer
from aiospawn._core._concurrency import Broadcast
from aiospawn._core._context import AsyncProcessContext
from aiospawn._core._outcome import RankExit
from aiospawn._core._policy import RestartPolicy, Supervision
from aiospawn._core._spec import DEFAULT_PREFIX, LaunchSpec, make_output_spec, make_spec
from aiospawn._rank import channel as rank_channel
from aiospawn._rank.reader import FrameReader
from aiospawn._rank.wire import CALL_ID, FROM_RANK, HEADER, Kind, encode_exception
from aiospawn._rank.wire import Link as Frame


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds``."""
        self.now += seconds


class MemoryLink:
    """One attempt's channel in memory (the seam's ``Link``); the test plays the rank's end.

    What the rank sends is a byte stream, parsed by the real frame reader: the
    test sends whole frames (:meth:`message`, :meth:`ready`, :meth:`reply`) or
    any bytes (:meth:`send_bytes`). What the supervisor writes waits in
    :attr:`unread` until the rank reads it (:meth:`read`); at most ``window`` bytes
    wait there, as in a socket's buffer, so a rank that does not read holds
    the supervisor's sends back.
    """

    shares_memory = False

    def __init__(self, window: int = 64 * 1024) -> None:
        self.window = window
        self.unread: collections.deque[tuple[int, bytes]] = collections.deque()
        self.changed = Broadcast()
        self._incoming = bytearray()
        self._reader = FrameReader(FROM_RANK)
        self._out: collections.deque[tuple[int, bytes]] = collections.deque()
        self._rank_closed = False
        self._released = False
        #: The ids of the CANCEL frames :meth:`calls` read.
        self.cancelled: list[int] = []

    # The seam (Link), as the group's channel code calls it.

    async def receive_frame(self) -> tuple[int, bytes | bytearray] | None:
        """The next frame the rank sent, or None at its end; waits for one."""
        while (frame := self.frame_now()) is False:
            await self.changed.wait()
        assert frame is not True
        return frame

    def frame_now(self) -> tuple[int, bytes | bytearray] | bool | None:
        """The next frame if the rank has sent it whole; None at the end, else False."""
        if self._released:
            return None
        while self._incoming:
            size = min(self._reader.wanted, len(self._incoming))
            chunk = bytes(self._incoming[:size])
            del self._incoming[:size]
            self._reader.feed(chunk)
            frame = self._reader.frame()
            if frame is not None:
                self._reader = FrameReader(FROM_RANK)
                return frame
        return None if self._rank_closed else False

    def queue_frame(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        """Queue a frame for the rank (it carries no descriptor: memory is not shared)."""
        assert fd < 0
        self._out.append((kind, prefix + bytes(payload)))

    @property
    def queued(self) -> int:
        """Bytes queued and not yet written."""
        return sum(HEADER.size + len(payload) for _, payload in self._out)

    def write_some(self) -> bool:
        """Move whole frames to the rank while its window has room; True once all went."""
        if self._released or self._rank_closed:
            raise BrokenPipeError("the rank's end is closed")
        while self._out and self._waiting() < self.window:
            self.unread.append(self._out.popleft())
            self.changed.notify()
        return not self._out

    async def wait_writable(self) -> None:
        """Wait until the rank's window has room (or either end is gone)."""
        while self._waiting() >= self.window and not (self._released or self._rank_closed):
            await self.changed.wait()

    def close(self) -> None:
        """Release our end."""
        self._released = True
        self._out.clear()
        self.changed.notify()

    # The rank's end, as the test plays it.

    @property
    def released(self) -> bool:
        """The supervisor released its end."""
        return self._released

    @property
    def unsent(self) -> int:
        """Bytes the rank sent that the supervisor has not read yet."""
        return len(self._incoming)

    def send_bytes(self, data: bytes) -> None:
        """The rank writes ``data`` on its end."""
        self._incoming += data
        self.changed.notify()

    def send(self, kind: int, payload: bytes = b"") -> None:
        """The rank sends one frame."""
        self.send_bytes(HEADER.pack(kind, len(payload)) + payload)

    def message(self, item: Any) -> None:
        """The rank's ``channel().send(item)``."""
        self.send(Frame.MESSAGE, pickle.dumps(item))

    def ready(self, payload: Any = None) -> None:
        """The rank's ``aiospawn.ready(payload)``."""
        self.send(Frame.READY, pickle.dumps(payload))

    def calls(self) -> list[tuple[int, str, tuple[Any, ...], dict[str, Any]]]:
        """The calls sent that the rank has not read: ``(id, method, args, kwargs)``.

        The CANCEL frames among them go to :attr:`cancelled`, in order.
        """
        found = []
        for kind, payload in self.read():
            if kind == Frame.CANCEL:
                self.cancelled += CALL_ID.unpack(payload)
                continue
            assert kind == Frame.CALL, f"a frame of kind {kind} where calls were expected"
            call_id, request = rank_channel._split(payload)
            found.append((call_id, *rank_channel._request(request)))
        return found

    def reply(self, call_id: int, value: Any = None, *, error: BaseException | None = None) -> None:
        """The rank's handler answers call ``call_id`` with ``value``, or raised ``error``."""
        packed = rank_channel.reply(call_id, error is None, value if error is None else error)
        self.send(Frame.REPLY, packed.prefix + packed.body)

    def read(self) -> list[tuple[int, bytes]]:
        """Everything the supervisor wrote that the rank has not read: ``(kind, payload)``."""
        frames = list(self.unread)
        self.unread.clear()
        self.changed.notify()
        return frames

    def end(self) -> None:
        """The rank closes its end: the supervisor reads what was sent, then the end."""
        self._rank_closed = True
        self.changed.notify()

    def _waiting(self) -> int:
        return sum(HEADER.size + len(payload) for _, payload in self.unread)


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeProcess:
    """What ``aiospawn.sync`` reads of a rank's process object: ids, no process."""

    pid: int
    sentinel: int


class FakeRank:
    """One attempt at one rank; it starts, beats and exits when the test says."""

    def __init__(self, backend: FakeBackend, index: int, restart: int) -> None:
        self._backend = backend
        self.rank = index
        self.restart = restart
        self.link = MemoryLink() if backend.links else None
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
        #: Who recorded the exit: "wait" (the owner's watch) or "poll" (anyone else).
        self.recorded_by: str | None = None
        self._in_wait = False

    @property
    def process(self) -> FakeProcess | None:
        """A stand-in for the process object, once started: nothing runs."""
        return None if self.pid is None else FakeProcess(pid=self.pid, sentinel=self.pid)

    # The seam (RankHandle), as the group calls it.

    def exited(self) -> bool:
        """True once the test has declared the exit; records nothing."""
        return self.exit is not None or self._ending is not None

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
            self.recorded_by = "wait" if self._in_wait else "poll"
            self._backend.changed.notify()
        return self.exit

    async def wait(self) -> RankExit:
        """Wait until the test ends the rank (or a signal does, or ``runs_for`` passes)."""
        if self._backend.runs_for is not None:
            with anyio.move_on_after(self._backend.runs_for):
                await self._ended.wait()
            self.returns()  # nothing if a signal ended it first
        await self._ended.wait()
        await checkpoint()
        self._in_wait = True
        try:
            exit = self.poll()
        finally:
            self._in_wait = False
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

    def make_rank(self, index: int, restart: int) -> FakeRank:
        """Make attempt ``restart`` of rank ``index``, recorded in the backend."""
        rank = FakeRank(self._backend, index, restart)
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
        runs_for: If set, a started rank returns ``None`` by itself after this
            many seconds of real time, unless it ended before.
        links: Each attempt has a :class:`MemoryLink` (a channel), or none.
    """

    def __init__(self, clock: FakeClock | None = None, *, links: bool = False) -> None:
        self.links = links
        self.clock = clock or FakeClock()
        self.made: list[FakeRank] = []
        self.fail_start: dict[tuple[int, int], BaseException] = {}
        self.ignored_signals: set[int] = set()
        self.changed = Broadcast()
        self.next_pid = 10_000
        self.launcher: FakeLauncher | None = None
        self.runs_for: float | None = None

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
    spec = make_spec(_never_called, (), nprocs, "fork", False, output=output)
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
