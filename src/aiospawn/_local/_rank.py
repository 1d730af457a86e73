"""Exit detection for one local rank: readiness-driven, one watcher, exact exit codes.

A :class:`LocalRank` owns everything the supervisor holds for one rank's
process: the ``multiprocessing`` process object, a pidfd, and the read end of
the rank's result pipe. Its watcher waits, on the event loop, for two things
at once: the result frame (read as it arrives, so a large result never blocks
the rank in ``write``) and the process's exit (the pidfd, or for
``forkserver`` the sentinel, becoming readable). Then it reaps the process
and records a :class:`~aiospawn._outcome.RankExit`.

Only one task at a time waits on a rank's fds (a second waiter would get
``BusyResourceError``): :meth:`LocalRank.wait` lets the first caller watch and
makes the others wait for it (``SingleWatcher``); if the watcher is cancelled,
one of them takes over where it stopped.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import time
from multiprocessing.process import BaseProcess

import anyio

from aiospawn._core._concurrency import SingleWatcher, take_turn
from aiospawn._core._outcome import RankExit
from aiospawn._rank import descendants
from aiospawn._rank.reader import FrameReader
from aiospawn._rank.wire import ChildEnd, Kind, read_ended

from . import _pipes
from ._link import SocketLink
from ._output import RankOutput
from ._pipes import close_watched
from ._progress import RankProgress

_READ_CHUNK = 256 * 1024
#: At most this much of a frame is read per wake-up, so that the loop runs other tasks between.
_READ_BUDGET = 1024 * 1024


class LocalRank:
    """One rank running in a local process, from start to reaping.

    Args:
        rank: The rank's index.
        process: The (not yet started) process that will run it.
        reader: Read end of the rank's result pipe.
        writer: Write end, handed to the process and closed here once it started.
        output: The rank's stdout and stderr plumbing.
        exit_via_sentinel: Wait on the process sentinel rather than a pidfd.
            Under ``forkserver`` the server reaps the rank and sends the exit
            status through the sentinel, so a pidfd would wake us before the
            status can be read.
        progress: The rank's heartbeat slot and stack channel, when the
            group watches heartbeats.
        link: Our end of the rank's channel; ``link_end`` is the rank's,
            closed here once it started.
    """

    def __init__(
        self,
        rank: int,
        process: BaseProcess,
        reader: int,
        writer: ChildEnd,
        output: RankOutput,
        *,
        exit_via_sentinel: bool,
        progress: RankProgress | None = None,
        link: SocketLink | None = None,
        link_end: ChildEnd | None = None,
    ) -> None:
        self.rank = rank
        self.process = process
        self._reader: int | None = reader
        self._writer: ChildEnd | None = writer
        self._output = output
        self._exit_via_sentinel = exit_via_sentinel
        self._progress = progress
        self.link = link
        self._link_end = link_end
        self._frame = FrameReader()
        self._ended_at: float | None = None  # when fn ended, if the rank said
        self._result_eof = False
        self._pidfd: int | None = None
        self._exit_fd = -1
        self._started = False
        self._stopped_by_us = False
        # Pidfds of the rank's descendants when we last signalled it: killed
        # when the rank exits, should they outlive it.
        self._strays: list[int] = []
        self._exit: RankExit | None = None
        self._watcher = SingleWatcher()

    @property
    def started(self) -> bool:
        """True once the process has been started."""
        return self._started

    @property
    def pid(self) -> int | None:
        """The process id, once started."""
        return self.process.pid

    @property
    def exit(self) -> RankExit | None:
        """How the rank ended, once it has been reaped."""
        return self._exit

    def start(self) -> None:
        """Start the process. Blocking: call it from a worker thread.

        ``Process.start()`` can block until the child has read its arguments
        (the pipe holds 64 KiB), which is why starts run on threads.
        """
        try:
            self.process.start()
        finally:
            assert self._writer is not None
            _pipes.close(self._writer.fd)  # the rank holds its own copy now
            self._writer = None
            if self._link_end is not None:
                _pipes.close(self._link_end.fd)
                self._link_end = None
        # cpython#148318: Process.start() on any thread reaps whichever of the
        # children it knows of have exited; two threads reaping one child can
        # lose its exit code. This rank is reaped by its watcher alone.
        multiprocessing.process._children.discard(self.process)  # type: ignore[attr-defined]
        pid = self.process.pid
        assert pid is not None
        self._output.started(pid)
        if self._progress is not None:
            self._progress.started()
        with contextlib.suppress(AttributeError, OSError):  # no pidfd: not Linux, or old
            self._pidfd = _pipes.track(os.pidfd_open(pid))
        if self._pidfd is not None and not self._exit_via_sentinel:
            self._exit_fd = self._pidfd
        else:
            self._exit_fd = self.process.sentinel
        assert self._reader is not None
        os.set_blocking(self._reader, False)
        self._started = True

    def discard(self) -> None:
        """Release the pipes of a rank whose start failed."""
        if self._writer is not None:
            _pipes.close(self._writer.fd)
            self._writer = None
        if self._reader is not None:
            _pipes.close(self._reader)
            self._reader = None
        if self._link_end is not None:
            _pipes.close(self._link_end.fd)
            self._link_end = None
        if self.link is not None:
            self.link.close()
        self._output.discard()
        if self._progress is not None:
            self._progress.close()

    def exited(self) -> bool:
        """True once the rank has exited: its exit descriptor is readable. Reaps nothing."""
        if self._exit is not None:
            return True
        if not self._started or self._exit_fd < 0:
            return False
        return _pipes.readable(self._exit_fd)

    def poll(self) -> RankExit | None:
        """Make progress without waiting: read what the rank sent, reap it if it exited."""
        if self._exit is None and self._started:
            self._read_available()
            exit_code = self._reap()
            if exit_code is not None:
                self._read_available(None)  # the end of the frame, written just before exit
                self._finish(exit_code)
        return self._exit

    def _reap(self) -> int | None:
        """Reap the rank if it exited, after killing what is left of its process group."""
        pid = self.process.pid
        assert pid is not None
        if self._exit_fd == self._pidfd:  # we reap the rank ourselves, not a fork server
            try:
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped elsewhere already: exitcode knows
                pass
            else:
                if exited is None:
                    return None  # still running
                # Exited, not yet reaped: its pid, and so its group id, cannot
                # be reused yet. What it left in its group (it returned, called
                # os._exit, exec'd, or was killed) dies with it. Under forkserver
                # the server reaps the rank at once; there the rank's own sweep
                # is all there is (see _rank.descendants).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        exit_code = self.process.exitcode
        if exit_code is not None:
            # And the descendants our signal reached while it ran (a SIGTERM
            # they ignored while the rank died of it), in its group or not.
            # Pidfds: safe under forkserver too, where the rank's pid, so its
            # group id, may be reused by now.
            descendants.signal_pinned(self._strays, signal.SIGKILL)
            descendants.close_pinned(self._strays)
            self._strays = []
        return exit_code

    async def wait(self) -> RankExit:
        """Wait until the rank has exited and been reaped; return how it ended."""
        await self._watcher.run(lambda: self._exit is not None, self._watch)
        await anyio.lowlevel.checkpoint()
        assert self._exit is not None
        return self._exit

    def send_signal(self, signum: int) -> bool:
        """Signal the rank and its process group, unless it has already exited.

        The rank is marked as stopped by us, so its death is never reported as
        the group's root cause. A rank that has exited is never signalled:
        once reaped, its pid may belong to another process.

        Returns:
            True if the signal was sent.
        """
        if not self._started or self.poll() is not None:
            return False
        self._stopped_by_us = True
        pid = self.process.pid
        assert pid is not None
        # The rank's descendants that left its group (setsid, a new session)
        # are in its tree while it lives (it is their subreaper); pinned first,
        # since once the rank dies of this signal they are re-parented away.
        outside, inside = descendants.pin_descendants(pid, group=pid)
        self._signal_group(pid, signum)
        descendants.signal_pinned(outside, signum)  # killpg reached the others
        descendants.close_pinned(self._strays)
        self._strays = outside + inside
        return True

    def pass_signal(self, signum: int) -> bool:
        """Send ``signum`` to the running rank and its process group; it is not stopped by us.

        Reads, reaps and records nothing (the owner does). The rank runs
        until its pidfd says it exited, which comes before anyone (we, a fork
        server, a template) can reap it and free its pid.

        Returns:
            True if the signal was sent; False if the rank is not running.
        """
        if not self._started or self._exit is not None:
            return False
        # Without a pidfd (Linux < 5.3), the exit descriptor: under forkserver
        # and warm starts it is readable only once the rank's parent reaped it.
        if _pipes.readable(self._pidfd if self._pidfd is not None else self._exit_fd):
            return False
        pid = self.process.pid
        assert pid is not None
        self._signal_group(pid, signum)
        return True

    def _signal_group(self, pid: int, signum: int) -> None:
        try:
            # The rank leads its own process group (see _rank.process), which
            # holds the children it started too. The caller saw the rank
            # running: under spawn and fork it is not reaped (we reap it), so
            # nobody else has its pid or group id; where a fork server or a
            # template reaps it, only in the microseconds since that check.
            os.killpg(pid, signum)
        except ProcessLookupError:  # not a group leader yet: it is still starting
            with contextlib.suppress(ProcessLookupError):
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signum)
                else:
                    os.kill(pid, signum)

    def last_beat(self) -> float | None:
        """``time.monotonic()`` of the rank's last heartbeat, or None if none yet."""
        return self._progress.last_beat() if self._progress is not None else None

    async def stack(self, patience: float) -> str | None:
        """Every thread's Python stack, from the running rank; None if it did not answer."""
        if self._progress is None or not self._started or self.poll() is not None:
            return None
        pid = self.process.pid
        assert pid is not None
        return await self._progress.stack(self._pidfd, pid, patience)

    def _release_sentinel(self) -> None:
        # The Popen's sentinel pipe would stay open until the Process object is
        # garbage-collected. Popen.close() (what Process.close() calls) releases
        # it now; the Process keeps its exit code, and is_alive(), join() and
        # exitcode answer from it without touching the pipe.
        popen = getattr(self.process, "_popen", None)
        if popen is None:
            return
        if self._exit_fd == self.process.sentinel:
            anyio.notify_closing(self._exit_fd)
        popen.close()

    async def _watch(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_until_complete)
            for stream in self._output.streams:
                tg.start_soon(stream.pump)
            with contextlib.suppress(anyio.ClosedResourceError):
                await anyio.wait_readable(self._exit_fd)
            # Reaping costs system calls (the group's SIGKILL, waitpid): when
            # many ranks die together, their watchers share the loop's time.
            await take_turn()
            self.poll()  # report the exit before the readers unwind
            tg.cancel_scope.cancel()
        while self.poll() is None:
            # Readable, yet no exit status. A plain sentinel becomes readable a
            # moment before the child can be reaped; with a pidfd, another
            # thread polling the same Process (is_alive()) may be midway
            # through reaping it. Either way the status is due within moments.
            await anyio.to_thread.run_sync(self.process.join, 0.1)

    async def _read_until_complete(self) -> None:
        while self._exit is None and not (self._frame.complete or self._result_eof):
            assert self._reader is not None  # closed only once the exit is recorded
            try:
                await anyio.wait_readable(self._reader)
            except anyio.ClosedResourceError:
                return
            self._read_available()

    def _read_available(self, budget: int | None = _READ_BUDGET) -> None:
        fd = self._reader
        if fd is None:
            return
        # While the rank writes a large frame, the pipe refills as fast as it
        # is read: without a budget, one call would read the whole frame on
        # the loop. Once the rank has exited, what is left is bounded by the
        # pipe's capacity.
        while not (self._frame.complete or self._result_eof):
            if budget is not None:
                if budget <= 0:
                    return
                budget -= _READ_CHUNK
            try:
                data = os.read(fd, min(self._frame.wanted, _READ_CHUNK))
            except BlockingIOError:
                return
            if not data:
                self._result_eof = True
            self._frame.feed(data)
            frame = self._frame.frame()
            if frame is not None and frame[0] == Kind.ENDED:  # the outcome follows
                self._ended_at = read_ended(frame[1])
                self._frame = FrameReader()

    def _finish(self, exit_code: int) -> None:
        pid = self.process.pid
        assert pid is not None
        try:
            self._output.drain()  # what the rank wrote just before it exited
        finally:
            self._record(exit_code, pid)

    def _record(self, exit_code: int, pid: int) -> None:
        self._exit = RankExit(
            rank=self.rank,
            pid=pid,
            exit_code=exit_code,
            frame=self._frame.frame(),
            stopped_by_us=self._stopped_by_us,
            stderr_tail=self._output.stderr_tail(),
            # A warm rank whose template died: said so, not blamed on the OOM killer.
            cause=getattr(self.process, "exit_cause", None),
            # Without the rank's word (killed by a signal, os._exit), now:
            # when this supervisor saw the exit.
            ended_at=time.time() if self._ended_at is None else self._ended_at,
        )
        descendants.close_pinned(self._strays)
        self._strays = []
        # The exit holds the payload now (until the context decodes it and
        # lets it go); the reader must not keep a second reference for our life.
        self._frame = FrameReader()
        for fd in (self._reader, self._pidfd):
            if fd is not None:
                close_watched(fd)
        self._reader = self._pidfd = None
        if self._progress is not None:
            self._progress.close()
        self._release_sentinel()
