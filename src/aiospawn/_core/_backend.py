"""The seam between a group's supervision and where its ranks run.

:class:`~aiospawn.AsyncProcessContext` supervises (fail-fast, shutdown,
restarts, hang detection, events) and knows nothing of processes; a backend
makes and starts ranks, and each rank is a :class:`RankHandle` that reports
its one exit and carries a :class:`Link`, the frames of its channel. The
local backend (``aiospawn._local``) runs ranks as child processes;
``aiospawn.ray.RayBackend`` runs them as Ray actors.

A rank handle is one *attempt* at a rank: a restarted rank is a new handle
in the same slot, made by the same launcher. :class:`RankHandle` is what
every backend's handles do; what only some can do is a capability of its own
(:class:`HasHeartbeats`, :class:`HasStacks`, :class:`HasProcess`,
:class:`HasSignals`), which the core checks for before it asks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from aiospawn._rank.wire import Payload

from ._capture import CaptureBuffer
from ._outcome import RankExit
from ._spec import LaunchSpec


def raise_start_error(errors: Mapping[int, BaseException], count: int, where: str = "") -> None:
    """Raise the start error of the lowest failing rank, with a note naming it.

    The contract of :meth:`GroupLauncher.start`: whichever start failed first
    in time, the report names the lowest rank, so that it reads the same on
    every run. ``count`` is how many ranks were being started, ``where`` ends
    the note (``" on Ray"``). Does nothing when ``errors`` is empty.
    """
    if errors:
        index = min(errors)
        error = errors[index]
        error.add_note(f"aiospawn: raised while starting rank {index} of {count}{where}")
        raise error


class Link(Protocol):
    """One attempt's frame transport, from the backend (a socket pair for local ranks)."""

    #: True if frames may carry a memfd (``_rank.buffers``): the large buffers
    #: of what is sent then go through shared memory.
    shares_memory: bool

    async def receive_frame(self) -> tuple[int, Payload] | None:
        """The next frame, or None at the end of the stream.

        One task at a time. Cancellation-safe: a frame read in part is kept.
        Frames are checked as their headers complete, against what a rank may
        send (``wire.FROM_RANK``).

        Raises:
            FrameError: The rank sent a header that breaks the format; the
                stream cannot be read further.
        """

    def frame_now(self) -> tuple[int, Payload] | bool | None:
        """The next frame if it can be read without waiting; None at the end, else False.

        Raises:
            FrameError: As :meth:`receive_frame`.
        """

    def queue_frame(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        """Add a frame, whole, to the outgoing queue.

        The frame's payload is ``prefix`` (a call's id) then ``payload``, which
        is not copied to be joined to it: one large ``payload`` may be queued
        on several links. ``fd`` (a memfd, only if :attr:`shares_memory`) goes
        with the frame; the caller keeps its own and closes it.
        """

    @property
    def queued(self) -> int:
        """Bytes queued and not yet written."""

    def write_some(self) -> bool:
        """Write what can be written now; True once the queue is empty.

        Raises:
            BrokenPipeError: The rank's end is closed (it exited).
        """

    async def wait_writable(self) -> None:
        """Wait until :meth:`write_some` can make progress."""

    def close(self) -> None:
        """Release the transport; a task waiting in :meth:`receive_frame` gets None."""


class RankHandle(Protocol):
    """One attempt at one rank, from creation to its recorded exit."""

    @property
    def link(self) -> Link | None:
        """The attempt's channel transport, or None if the backend has none."""

    @property
    def rank(self) -> int:
        """The rank's index."""

    @property
    def started(self) -> bool:
        """True once the rank is running (its start succeeded)."""

    @property
    def pid(self) -> int | None:
        """The id of the process running the rank, once started."""

    @property
    def exit(self) -> RankExit | None:
        """How the attempt ended, once it has ended and been cleaned up."""

    def exited(self) -> bool:
        """True once the attempt has ended, whether or not its exit is recorded yet.

        A query: it reads, reaps and tells nothing (the owner's :meth:`wait`
        does all three).
        """

    def poll(self) -> RankExit | None:
        """Reap the rank if it has exited, without waiting; return the exit if known now.

        Tells nobody: the group learns of the exit from :meth:`wait`.
        """

    async def wait(self) -> RankExit:
        """Wait for the exit. Several tasks may call this at once; one watches.

        While it waits, the rank's output is read and what it sends is taken
        in, so that the rank never blocks on a full pipe: the group's owner
        waits here for as long as the attempt runs.
        """

    def discard(self) -> None:
        """Release what a rank that will never start holds."""

    def send_signal(self, signum: int) -> bool:
        """Ask the rank to stop: ``SIGTERM`` politely, ``SIGKILL`` at once.

        Marks the attempt as stopped by us. Returns False, and does nothing,
        if the rank is not running (not started, or already exited).
        """


@runtime_checkable
class HasHeartbeats(Protocol):
    """A rank handle that can tell when its rank last beat (an optional capability)."""

    def last_beat(self) -> float | None:
        """``time.monotonic()`` of the rank's last heartbeat, or None if none yet.

        Only asked when the group watches heartbeats (see ``LaunchSpec``).
        """


@runtime_checkable
class HasStacks(Protocol):
    """A rank handle that can take its running rank's Python stacks (an optional capability)."""

    async def stack(self, patience: float) -> str | None:
        """The Python stacks of every thread of the running rank, or None.

        None when the rank did not answer within ``patience`` seconds (it blocks
        every signal, or is stuck in the kernel) or the backend cannot ask.
        """


@runtime_checkable
class HasSignals(Protocol):
    """A rank handle that can pass any signal on to its rank (an optional capability)."""

    def pass_signal(self, signum: int) -> bool:
        """Send ``signum`` to the running rank: unlike :meth:`RankHandle.send_signal`, no stop.

        What ``AsyncProcessContext.send_signal()`` calls (the handle's own
        ``send_signal`` is the stop). The attempt is not marked as stopped by
        us: if the signal kills the rank, that is the rank's failure. Reaps
        and reads nothing: the owner does.

        Returns:
            True if the signal was sent; False if the rank is not running.
        """


@runtime_checkable
class HasProcess(Protocol):
    """A rank handle with a ``multiprocessing`` process object (an optional capability)."""

    @property
    def process(self) -> Any:
        """The ``multiprocessing`` process object."""


class GroupLauncher(Protocol):
    """Makes and starts the ranks of one group, for as long as the group lives."""

    def make_rank(self, index: int, restart: int) -> RankHandle:
        """Create, without starting, attempt number ``restart`` of rank ``index``."""

    async def start(self, ranks: Sequence[RankHandle]) -> None:
        """Start ``ranks`` together; return once every start has finished.

        Ranks whose start did not happen have their resources released.

        Raises:
            Exception: The start error of the lowest failing rank, with a note
                (see :func:`raise_start_error`).
        """

    def new_rendezvous(self) -> None:
        """Let the next whole-group start use a fresh rendezvous (``MASTER_PORT``)."""

    async def aclose(self) -> None:
        """Release what the group holds, once every rank has exited. Idempotent."""


class Backend(Protocol):
    """Where a group's ranks run: local processes by default."""

    def check(self, spec: LaunchSpec) -> None:
        """Refuse, before anything starts, what this backend cannot run.

        Each backend's refusals, written once: the entry points call it after
        ``_spec.make_spec`` and before :meth:`open`, and ``aiospawn run``'s
        plan calls it too. The first read of ``spec.output`` runs the user's
        per-rank output options, so a bound on ``nprocs`` that needs none of
        them comes first. Does not block and starts nothing.

        Raises:
            ValueError: ``spec`` asks for something this backend cannot do,
                or for more ranks than it can hold.
            TypeError: ``fn`` or ``args`` cannot reach this backend's ranks.
        """

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> GroupLauncher:
        """Prepare to run the group ``spec`` (connect, check); nothing is started yet.

        Raises:
            ValueError: ``spec`` asks for something this backend cannot do.
        """
