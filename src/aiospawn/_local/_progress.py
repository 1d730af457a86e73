"""The supervisor's side of a rank's heartbeats and of its stack dumps.

A rank's heartbeat is one ``time.monotonic_ns()`` stored in eight bytes of
memory shared with the supervisor (a memfd mapped on both sides), so a beat
costs the rank a clock read and a store, and the supervisor reads it without
a system call. ``CLOCK_MONOTONIC`` is one clock for every process of the
machine, so the two sides' readings compare directly.

When a rank is found hung, the supervisor sends it ``STACK_SIGNAL``, on
which ``faulthandler`` in the rank writes every thread's Python stack into
a pipe to the supervisor (see ``_child``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal

import anyio

from aiospawn._rank import bootstrap, outcome
from aiospawn._rank.wire import BEAT_BYTES, STACK_SIGNAL, ChildEnd

from . import _pipes
from ._pipes import close_watched, rank_pipe

#: The frames of ours that start a rank's own, as faulthandler names them: the
#: rule that calls ``fn``, and the bootstrap that calls it (a rank that is not
#: in ``fn`` yet, or no more).
_OURS = (f'"{outcome.__file__}"', " in run_fn"), (f'"{bootstrap.__file__}"', " in run_rank")

#: A stack dump is complete once the pipe has been quiet this long.
_DUMP_QUIET = 0.1

#: The most of a dump kept: faulthandler writes at most 100 frames of at most
#: 100 threads, far less than this.
_DUMP_LIMIT = 1 << 20


class RankProgress:
    """One rank's heartbeat slot and stack channel, seen from the supervisor."""

    def __init__(self) -> None:
        memory = _pipes.track(os.memfd_create("aiospawn-heartbeat", os.MFD_CLOEXEC))
        try:
            os.ftruncate(memory, BEAT_BYTES)
            self._shared = mmap.mmap(memory, BEAT_BYTES)
        except BaseException:
            _pipes.close(memory)
            raise
        with contextlib.suppress(AttributeError, OSError):  # no MADV_DONTFORK: not Linux
            # A fork rank must not inherit its siblings' slots (it could
            # forge their heartbeats); it maps its own from the memfd.
            self._shared.madvise(mmap.MADV_DONTFORK)
        self._beat = memoryview(self._shared).cast("q")
        self._reader: int | None = None
        #: The ends the rank gets; ours are closed once it has its copies.
        self.child_ends: tuple[ChildEnd, ...] = (ChildEnd(memory),)
        try:
            self._reader, stacks = rank_pipe()
            os.set_blocking(self._reader, False)
        except BaseException:
            self.close()
            raise
        self.child_ends = (ChildEnd(memory), stacks)

    def started(self) -> None:
        """Close our copies of the rank's ends, once the rank has its own."""
        for end in self.child_ends:
            _pipes.close(end.fd)
        self.child_ends = ()

    def last_beat(self) -> float | None:
        """The rank's last heartbeat on the ``time.monotonic()`` clock, if it beat."""
        if self._shared.closed:
            return None
        beat = self._beat[0]
        return beat / 1e9 if beat else None

    def answers_stack_requests(self) -> bool:
        """True once the rank has set up its answer to :data:`STACK_SIGNAL`."""
        return not self._shared.closed and self._beat[1] == 1

    async def stack(self, pidfd: int | None, pid: int, patience: float) -> str | None:
        """Ask the running rank for its threads' stacks; None if none came in ``patience`` s.

        A rank still importing its modules cannot answer yet (the signal would
        end it): None at once.
        """
        if not self.answers_stack_requests():
            await anyio.lowlevel.checkpoint()
            return None
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, STACK_SIGNAL)
            else:
                os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return None
        dump = bytearray()
        with anyio.move_on_after(patience):
            # Wait for the first bytes, then read until the pipe is quiet.
            while len(dump) < _DUMP_LIMIT:
                with anyio.move_on_after(_DUMP_QUIET if dump else patience) as quiet:
                    chunk = await self._read()
                if quiet.cancelled_caught or not chunk:
                    break
                dump += chunk
        return _tidy(dump.decode(errors="replace")) if dump else None

    async def _read(self) -> bytes:
        """What the pipe holds once readable; empty if it was closed meanwhile."""
        while self._reader is not None:
            try:
                await anyio.wait_readable(self._reader)
                return os.read(self._reader, 65536)
            except anyio.ClosedResourceError:  # the rank exited, and was recorded
                break
            except BlockingIOError:
                continue
        return b""

    def close(self) -> None:
        """Release the slot and the pipe (idempotent)."""
        for end in self.child_ends:
            _pipes.close(end.fd)
        self.child_ends = ()
        if self._reader is not None:
            close_watched(self._reader)
            self._reader = None
        if not self._shared.closed:
            self._beat.release()
            self._shared.close()


def _tidy(dump: str) -> str:
    """The user's part of a faulthandler dump: one paragraph per thread.

    Dropped: the guard thread that watches the supervisor (ours), and in each
    thread the frames from the one that calls ``fn`` down (``run_fn``, the
    bootstrap's ``run_rank`` and what started it, which under ``fork``
    includes the supervisor's own frames).
    """
    threads = []
    for thread in dump.strip("\n").split("\n\n"):
        if "in _die_with_supervisor" in thread:
            continue
        lines = thread.splitlines()
        for index, line in enumerate(lines):
            if any(line.endswith(name) and file in line for file, name in _OURS):
                lines = lines[:index]
                break
        threads.append("\n".join(lines))
    return "\n\n".join(threads) + "\n"
