"""Warm starts, seen from the supervisor: one template process that ranks are forked from.

With ``preload=[...]``, a group's ranks are not started by ``multiprocessing``:
each is forked by a template process that imported those modules once (the
template's own side, and the protocol, are in ``aiospawn._rank.template``).
A :class:`Template` is one such process: its spawn, its control socket, its
handshake, its forks and its stop. Which template a start uses, and when an
idle one is stopped, is the table's (``_templates``). A rank forked from a
template is a :class:`~._warm.WarmProcess`.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.process
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio

from aiospawn._core._concurrency import run_to_completion
from aiospawn._core._errors import describe_exit
from aiospawn._core._log import logger
from aiospawn._rank.template import MAX_FDS, PAYLOAD_SIZE, STATUS, serve
from aiospawn._rank.wire import ChildEnd

from . import _pipes

#: Seconds a template may take to exit once its control socket is closed.
STOP_PATIENCE = 5.0


class TemplateError(RuntimeError):
    """A warm-start template could not be started, refused, or died during a start.

    Raised by a group's start (``start_processes``, ``spawn``, ``open_group``,
    a restart) with ``preload=``; the ranks already started are stopped and
    reaped first, as for any start error.
    """


class TemplateKey(NamedTuple):
    """What a template's imports depend on: groups that agree on all of it share one."""

    preload: tuple[str, ...]
    sys_path: tuple[str, ...]
    environ: tuple[tuple[str, str], ...]

    @classmethod
    def current(cls, preload: tuple[str, ...]) -> TemplateKey:
        """The key of ``preload`` in this process, now."""
        return cls(preload, tuple(sys.path), tuple(sorted(os.environ.items())))


class Template:
    """One template process and the supervisor's end of its control socket.

    Made (not started) by :func:`acquire`; :meth:`spawn` starts its process,
    :meth:`wait_ready` waits until it has imported its preload and said it is
    safe to fork.
    """

    def __init__(self, key: TemplateKey) -> None:
        self.key = key
        self.process: multiprocessing.process.BaseProcess | None = None
        self._control: socket.socket | None = None
        #: A pidfd of the template, for waiters to learn of its death (None
        #: without pidfds: the sentinel then).
        self._pidfd: int | None = None
        self._spawn_lock = threading.Lock()  # this template's alone: held while it is spawned
        self._spawn_error: BaseException | None = None
        self._lock = threading.Lock()  # one request at a time on the control socket
        # One reaper at a time: of two threads in multiprocessing's waitpid()
        # on the same process, the loser gets ECHILD and no exit code, and may
        # read it before the winner has recorded it (two ranks' starts that
        # see the same death at once).
        self._reaping = threading.Lock()
        self._reply: bytes | None = None
        self._closed = False
        self._stopped = False
        #: The template's exit code, once stopped.
        self.exit_code: int | None = None
        #: Starts under way and ranks running from it (under the registry lock).
        self.users = 0
        #: ``time.monotonic()`` when it was last used.
        self.last_used = time.monotonic()

    def __repr__(self) -> str:
        pid = None if self.process is None else self.process.pid
        state = {None: "starting", b"R": "ready"}.get(self._reply, "failed")
        return f"<Template pid={pid} {state} users={self.users} preload={list(self.key.preload)}>"

    @property
    def pid(self) -> int | None:
        """The template's pid, once spawned."""
        return None if self.process is None else self.process.pid

    @property
    def gone(self) -> bool:
        """True if it failed or exited (reaping it if so): the next start needs a new one."""
        if self._spawn_error is not None or self._closed:
            return True
        if self._reply is not None and self._reply[:1] != b"R":
            return True
        return self.process is not None and self.exit_status() is not None

    def exit_status(self) -> int | None:
        """The template's exit code if it has exited (reaping it), else None.

        Never waits (the event loop asks): None too while another thread reaps
        it, which then reports its death.
        """
        if self._stopped:
            return self.exit_code
        if not self._reaping.acquire(blocking=False):
            return None
        try:
            return None if self.process is None else self.process.exitcode
        except ValueError:  # closed by stop() meanwhile, on another thread
            return self.exit_code
        finally:
            self._reaping.release()

    def spawn(self) -> None:
        """Start the template's process, unless it was started already. Blocking, briefly.

        Returns once the process exists, not once it has imported anything:
        :meth:`wait_ready` waits for that.

        Raises:
            TemplateError: The process could not be started.
        """
        with self._spawn_lock:
            if self._spawn_error is not None:
                raise TemplateError(
                    f"the warm-start template could not be started: {self._spawn_error!r}"
                ) from self._spawn_error
            if self.process is not None:
                return
            try:
                self._spawn()
            except Exception as exc:
                self._spawn_error = exc
                raise TemplateError(
                    f"the warm-start template could not be started: {exc!r}"
                ) from exc
            except BaseException as exc:
                self._spawn_error = exc
                raise

    def _spawn(self) -> None:
        preload = self.key.preload
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # In the table of what a fork rank drops (_pipes): the template's
        # control socket, sentinel and pidfd are the supervisor's, not a rank's.
        _pipes.track(ours.fileno())
        # A fresh interpreter, as spawn gives a rank: nothing of this process's
        # threads, event loop or memory; its sys.path, argv and main script.
        context: Any = multiprocessing.get_context("spawn")
        process = context.Process(
            target=serve,
            args=(ChildEnd(theirs.fileno()), preload, os.getpid()),
            name="aiospawn-template",
        )
        try:
            process.start()
        except BaseException:
            _pipes.forget(ours.fileno())
            ours.close()
            raise
        finally:
            theirs.close()
        _pipes.track(process.sentinel)
        # Ours to reap, and ours to stop: not multiprocessing's to join at exit
        # (cpython#148318 for why no other thread may reap it either).
        multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
        with contextlib.suppress(AttributeError, OSError):  # no pidfd: the sentinel serves
            self._pidfd = _pipes.track(os.pidfd_open(process.pid))
        self._control = ours
        self.process = process

    async def wait_ready(self) -> None:
        """Wait until the template has imported its preload and is ready to fork.

        Waits on the event loop, on descriptors of its own (so that any
        number of starts, on any loops, can wait for one template).

        Raises:
            TemplateError: A preload module failed to import, or left the
                process unsafe to fork (threads, CUDA), or the template died.

        Cancellation: returns at once; the template imports on, and a later
        start of the same preload finds it.
        """
        while not self._poll_reply():
            assert self._control is not None
            assert self.process is not None
            # The reply stays queued on the control socket (it is only ever
            # peeked at), so the socket stays readable for every waiter; a
            # template that died says so on its pidfd, even if a process the
            # preload forked holds its end of the socket.
            death = self._pidfd if self._pidfd is not None else self.process.sentinel
            watched = [_pipes.track(os.dup(fd)) for fd in (self._control.fileno(), death)]
            try:
                await _pipes.wait_any_readable(watched)
            finally:
                for fd in watched:
                    _pipes.close(fd)
        reply = self._reply
        assert reply is not None
        if reply[:1] == b"R":
            return
        pid = self.pid
        if reply[:1] == b"E":
            raise TemplateError(
                f"warm starts refused: {reply[1:].decode('utf-8', 'replace')}"
                f" (preload={list(self.key.preload)!r})"
            )
        await on_a_thread(self.stop)  # for its exit code
        raise TemplateError(
            f"the warm-start template (pid {pid}) exited with"
            f" {describe(self.exit_code)} while importing preload={list(self.key.preload)!r};"
            " its stderr says why"
        )

    def _poll_reply(self) -> bool:
        """Read the template's answer if it came (or its death); True once known."""
        if self._reply is not None:
            return True
        assert self._control is not None
        dead = self.exit_status() is not None  # first: a reply sent before death is queued
        try:
            reply: bytes | None = self._control.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            reply = None
        except OSError:
            reply = b""
        if reply is None and not dead:
            return False
        with self._lock:
            if self._reply is None:
                self._reply = reply or b""
                if self._reply[:1] == b"R":
                    logger.debug(
                        "warm-start template %s ready, preload %s", self.pid, self.key.preload
                    )
                    for note in self._reply[1:].decode("utf-8", "replace").splitlines():
                        # Information, not a warning: the usual native thread
                        # (OpenBLAS's pool) is made again in a rank that needs
                        # it, and numpy starts it wherever numpy is imported.
                        logger.info("warm-start template %s: %s", self.pid, note)
        return True

    def fork(self, payload: bytes, fds: list[int]) -> tuple[socket.socket, int]:
        """Have the template fork a rank that reads ``payload``; return its status socket and pid.

        Blocking: the rank reads ``payload`` as it starts. ``fds`` are sent
        along, in the rank's ``ReceivedFd`` order. The template is ready
        (:meth:`wait_ready`), so it answers at once.

        Raises:
            TemplateError: The template died, or is gone, before the rank started.
        """
        if len(fds) + 1 > MAX_FDS:
            raise TemplateError(
                f"a warm rank's arguments may carry at most {MAX_FDS - 1} file descriptors"
                f" (pipes, connections, queues), got {len(fds)}"
            )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        _pipes.track(ours.fileno())
        try:
            with self._lock:
                if self._closed or self._control is None:
                    raise self._died()
                try:
                    socket.send_fds(self._control, [b"F"], [theirs.fileno(), *fds])
                except OSError as exc:
                    raise self._died() from exc
            theirs.close()
            try:
                ours.sendall(PAYLOAD_SIZE.pack(len(payload)) + payload)
                kind, pid = STATUS.unpack(self._read(ours, STATUS.size))
            except (OSError, EOFError) as exc:
                raise self._died() from exc
            assert kind == b"P", kind
        except BaseException:
            theirs.close()
            _pipes.forget(ours.fileno())
            ours.close()
            raise
        return ours, pid

    def stop(self) -> None:
        """Close the control socket, wait for the template to exit, reap it. Idempotent.

        Blocking: up to :data:`STOP_PATIENCE` seconds, then SIGKILL.
        """
        with self._spawn_lock:  # not while it is being spawned
            if self._stopped:
                return
            self._stopped = True
        with self._lock:
            self._closed = True
            if self._control is not None:
                _pipes.forget(self._control.fileno())
                self._control.close()  # end-of-file: the template exits
        process = self.process
        if process is None:
            return
        with self._reaping:
            process.join(STOP_PATIENCE)
            if process.exitcode is None:
                process.kill()
                process.join()
            self.exit_code = process.exitcode
        _pipes.forget(process.sentinel)
        process.close()
        if self._pidfd is not None:
            _pipes.close(self._pidfd)
            self._pidfd = None

    def _read(self, sock: socket.socket, size: int) -> bytes:
        # The rank's status socket gives end-of-file if the template died
        # (the rank, holding its end, dies with it); the template's pidfd
        # (or sentinel) says so at once when no rank holds it.
        assert self.process is not None
        death = self._pidfd if self._pidfd is not None else self.process.sentinel
        # poll, not select: select() refuses descriptors numbered 1024 and up.
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(death, select.POLLIN)
        data = b""
        while len(data) < size:
            ready = {fd for fd, _ in poller.poll()}
            if sock.fileno() not in ready:
                raise EOFError("the template exited")
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise EOFError("the template closed the rank's status socket")
            data += chunk
        return data

    def _died(self) -> TemplateError:
        self._closed = True
        assert self.process is not None
        with self._reaping:
            self.process.join(STOP_PATIENCE)
            exit_code = self.process.exitcode
        return TemplateError(
            f"the warm-start template (pid {self.process.pid}) died"
            f" ({describe(exit_code)}) before it could start the rank;"
            " the next start uses a new template"
        )


def describe(exit_code: int | None) -> str:
    return "exit status unknown" if exit_code is None else describe_exit(exit_code)


async def on_a_thread(blocking: Callable[[], object]) -> None:
    """Run ``blocking`` on a worker thread to its end, even if the caller is cancelled meanwhile."""
    await run_to_completion(functools.partial(anyio.to_thread.run_sync, blocking))
