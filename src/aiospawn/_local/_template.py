"""Warm starts, seen from the supervisor: shared templates, and ranks forked from them.

With ``preload=[...]``, a group's ranks are not started by ``multiprocessing``:
each is forked by a template process that imported those modules once (the
template's own side, and the protocol, are in ``aiospawn._rank.template``).

- :class:`Template`: one template process, its control socket, its handshake.
- :func:`template_for`: the template of a preload list, shared by every group
  of this process whose preload list, ``sys.path`` and environment agree;
  started on first use, started again if it died.
- :class:`WarmProcess`: what a :class:`~aiospawn._local._rank.LocalRank` holds
  in place of a ``multiprocessing`` process: ``start()`` asks the template to
  fork, ``sentinel`` becomes readable once the template reaped the rank, and
  ``exitcode`` is then the status the template sent, exact as for any rank.
- :func:`stop_all`: stop every template (at interpreter exit, and in tests).

Starting a template blocks (it imports the preload), so it happens inside
``WarmProcess.start()``, which the launcher runs on worker threads.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import multiprocessing.reduction
import os
import pickle
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from aiospawn._core._errors import describe_exit
from aiospawn._core._log import logger
from aiospawn._rank.bootstrap import RankSetup
from aiospawn._rank.template import MAX_FDS, PAYLOAD_SIZE, STATUS, FdCollector, serve
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
    """One running template process and the supervisor's end of its control socket.

    Made by :meth:`start`, which returns once the template has imported its
    preload and said it is safe to fork.
    """

    def __init__(self, process: multiprocessing.process.BaseProcess, control: socket.socket):
        self.process = process
        self._control = control
        self._lock = threading.Lock()  # one request at a time on the control socket
        self._closed = False
        #: The template's exit code, once stopped.
        self.exit_code: int | None = None

    @classmethod
    def start(cls, preload: tuple[str, ...]) -> Template:
        """Spawn a template, wait until it has imported ``preload``. Blocking.

        Raises:
            TemplateError: A preload module failed to import, or left the
                process unsafe to fork (threads, CUDA), or the template died.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # In the table of what a fork rank drops (_pipes): the template's
        # control socket and sentinel are the supervisor's, not a rank's.
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
        template = cls(process, ours)
        try:
            reply = template._receive_reply()
        except BaseException:
            template.stop()
            raise
        if reply.startswith(b"R"):
            logger.debug("warm-start template %s ready, preload %s", process.pid, preload)
            for note in reply[1:].decode("utf-8", "replace").splitlines():
                logger.warning("warm-start template %s: %s", process.pid, note)
            return template
        pid = process.pid
        template.stop()
        if reply.startswith(b"E"):
            raise TemplateError(
                f"warm starts refused: {reply[1:].decode('utf-8', 'replace')}"
                f" (preload={list(preload)!r})"
            )
        raise TemplateError(
            f"the warm-start template (pid {pid}) exited with"
            f" {_describe(template.exit_code)} while importing preload={list(preload)!r};"
            " its stderr says why"
        )

    @property
    def alive(self) -> bool:
        """True unless the template has exited (reaping it if so)."""
        return not self._closed and self.process.exitcode is None

    def fork(self, payload: bytes, fds: list[int]) -> tuple[socket.socket, int]:
        """Have the template fork a rank that reads ``payload``; return its status socket and pid.

        Blocking: the rank reads ``payload`` as it starts. ``fds`` are sent
        along, in the rank's ``ReceivedFd`` order.

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
                if self._closed:
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
        """Close the control socket, wait for the template to exit, reap it. Idempotent."""
        if self.exit_code is not None:
            return
        with self._lock:
            self._closed = True
            _pipes.forget(self._control.fileno())
            self._control.close()  # end-of-file: the template exits
        self.process.join(STOP_PATIENCE)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        self.exit_code = self.process.exitcode
        _pipes.forget(self.process.sentinel)
        self.process.close()

    def _receive_reply(self) -> bytes:
        watched = [self._control.fileno(), self.process.sentinel]
        while True:
            ready, _, _ = select.select(watched, [], [])
            if watched[0] in ready:
                return self._control.recv(1 << 20)
            if watched[1] in ready:
                return b""

    def _read(self, sock: socket.socket, size: int) -> bytes:
        # The rank's status socket gives end-of-file if the template died
        # (the rank, holding its end, dies with it); the template's sentinel
        # says so at once when no rank holds it.
        data = b""
        while len(data) < size:
            ready, _, _ = select.select([sock.fileno(), self.process.sentinel], [], [])
            if sock.fileno() not in ready:
                raise EOFError("the template exited")
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise EOFError("the template closed the rank's status socket")
            data += chunk
        return data

    def _died(self) -> TemplateError:
        self._closed = True
        self.process.join(STOP_PATIENCE)
        return TemplateError(
            f"the warm-start template (pid {self.process.pid}) died"
            f" ({_describe(self.process.exitcode)}) before it could start the rank;"
            " the next start uses a new template"
        )


def _describe(exit_code: int | None) -> str:
    return "exit status unknown" if exit_code is None else describe_exit(exit_code)


_templates: dict[TemplateKey, Template] = {}
_templates_lock = threading.Lock()


def template_for(preload: tuple[str, ...]) -> Template:
    """The running template of ``preload`` for this process's ``sys.path`` and environment.

    Started (blocking) if there is none, or if the last one died.

    Raises:
        TemplateError: As :meth:`Template.start`.
    """
    key = TemplateKey.current(preload)
    with _templates_lock:
        template = _templates.get(key)
        if template is not None and template.alive:
            return template
        if template is not None:
            logger.warning(
                "warm-start template %s exited (%s); starting a new one",
                template.process.pid,
                _describe(template.process.exitcode),
            )
            del _templates[key]
            template.stop()
        template = _templates[key] = Template.start(preload)
        return template


def stop_all() -> None:
    """Stop every template of this process (at exit; tests call it between tests)."""
    with _templates_lock:
        templates = list(_templates.values())
        _templates.clear()
    for template in templates:
        template.stop()


atexit.register(stop_all)


def running_templates() -> list[int]:
    """The pids of this process's templates (for tests and diagnostics)."""
    with _templates_lock:
        return [t.process.pid for t in _templates.values() if t.process.pid is not None]


class _StatusChannel:
    """The supervisor's ends of one warm rank: its status socket and a pidfd (its ``_popen``).

    ``LocalRank`` closes a process's ``_popen`` once the rank is reaped.
    """

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        sock.setblocking(False)
        self.pidfd: int | None = None
        with contextlib.suppress(OSError):
            self.pidfd = _pipes.track(os.pidfd_open(pid))
        self.closed = False
        #: True once the status socket gave end-of-file with no status: the template died.
        self.eof = False
        self._data = b""

    def read_status(self) -> int | EOFError | None:
        """The exit code, None if not sent yet, or EOFError if it never will be."""
        try:
            while len(self._data) < STATUS.size:
                chunk = self.sock.recv(STATUS.size - len(self._data))
                if not chunk:
                    self.eof = True
                    return EOFError()
                self._data += chunk
        except BlockingIOError:
            return None
        except OSError:
            # ECONNRESET: the rank died with its payload unread, and the
            # template with it (the last holder of the socket): no status comes.
            self.eof = True
            return EOFError()
        kind, code = STATUS.unpack(self._data)
        assert kind == b"X", kind
        return int(code)

    def exited(self) -> bool:
        """True once the rank's process has exited (whoever reaps it)."""
        if self.pidfd is None:
            return True
        ready, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(ready)

    def close(self) -> None:
        """Release both ends. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _pipes.forget(self.fd)
        self.sock.close()
        if self.pidfd is not None:
            _pipes.close(self.pidfd)
            self.pidfd = None


def _dumps(obj: object) -> bytes:
    # ForkingPickler.dumps returns a view of its buffer; released at once, or
    # the buffer complains when it is collected (BufferError, Python 3.13).
    with multiprocessing.reduction.ForkingPickler.dumps(obj) as view:
        return bytes(view)


class WarmProcess:
    """A rank forked by a template, with the parts of ``multiprocessing.Process`` we use.

    Args:
        preload: The template's preload list.
        fn: The user's function.
        index: The rank.
        args: Its further arguments.
        channel: The rank's end of its result pipe.
        setup: The rank's surroundings (``supervisor_is_parent`` False).
        name: The rank's process name.
        daemon: Kept for ``Process`` compatibility: the rank is a child of the
            template, which stops with the supervisor either way.
    """

    def __init__(
        self,
        preload: tuple[str, ...],
        fn: Callable[..., Any],
        index: int,
        args: tuple[Any, ...],
        channel: ChildEnd,
        setup: RankSetup,
        *,
        name: str,
        daemon: bool,
    ) -> None:
        self._preload = preload
        self._call = (fn, index, args, channel, name)
        self._setup = setup
        self.name = name
        self.daemon = daemon
        self.pid: int | None = None
        self._popen: _StatusChannel | None = None
        self._exitcode: int | None = None
        self._sentinel = -1
        self._template_pid: int | None = None
        #: What ended the rank, when its exit code alone would mislead.
        self.exit_cause: str | None = None

    def __repr__(self) -> str:
        state = "initial" if self.pid is None else ("started" if self._exitcode is None else "")
        code = "" if self._exitcode is None else f"exitcode={self._exitcode}"
        return f"<WarmProcess name={self.name!r} pid={self.pid} {state or code}>"

    @property
    def sentinel(self) -> int:
        """Readable once the template has sent the rank's exit status (or died)."""
        return self._sentinel

    @property
    def exitcode(self) -> int | None:
        """The rank's exit code (``-signal`` if a signal ended it), once known."""
        channel = self._popen
        if self._exitcode is None and channel is not None and not channel.closed:
            status = channel.read_status()
            if isinstance(status, int):
                self._exitcode = status
            elif isinstance(status, EOFError) and channel.exited():
                # The template died; the rank died with it (PR_SET_PDEATHSIG).
                logger.warning(
                    "the warm-start template died while %s (pid %s) ran; its exit status is lost",
                    self.name,
                    self.pid,
                )
                self._exitcode = -signal.SIGKILL
                self.exit_cause = (
                    f"its warm-start template (pid {self._template_pid}) died while it ran,"
                    " and the rank with it; the rank's own exit status is lost"
                )
        return self._exitcode

    def start(self) -> None:
        """Fork the rank from its template (starting the template first if needed). Blocking.

        Raises:
            TemplateError: As :func:`template_for` and :meth:`Template.fork`.
            Exception: ``fn`` or ``args`` could not be pickled.
        """
        collector = FdCollector()
        multiprocessing.context.set_spawning_popen(collector)  # type: ignore[arg-type]
        try:
            setup = _dumps(self._setup)
            call = _dumps(self._call)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        payload = pickle.dumps((setup, call), protocol=pickle.HIGHEST_PROTOCOL)
        template = template_for(self._preload)
        sock, self.pid = template.fork(payload, collector.fds)
        self._template_pid = template.process.pid
        self._popen = _StatusChannel(sock, self.pid)
        self._sentinel = self._popen.fd

    def is_alive(self) -> bool:
        """True between a successful start and the arrival of the exit status."""
        return self.pid is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the exit status. Blocking."""
        channel = self._popen
        if channel is None or channel.closed or self.exitcode is not None:
            return
        # After end-of-file the socket is always readable: wait for the
        # process itself instead.
        watched = [channel.pidfd] if channel.eof and channel.pidfd is not None else [channel.fd]
        with contextlib.suppress(InterruptedError):
            select.select(watched, [], [], timeout)
        self.exitcode  # noqa: B018  (reads the status if it came)

    def close(self) -> None:
        """Release the status socket and pidfd; the exit code stays readable."""
        if self._popen is not None:
            self.exitcode  # noqa: B018
            self._popen.close()
