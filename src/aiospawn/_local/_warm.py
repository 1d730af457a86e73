"""A rank forked from a warm-start template, seen from the supervisor.

:class:`WarmProcess` is what a :class:`~aiospawn._local._rank.LocalRank` holds
in place of a ``multiprocessing`` process: ``start()`` asks its template
(``_template``) to fork, ``sentinel`` becomes readable once the template
reaped the rank (or died), and ``exitcode`` is then the status the template
sent, exact as for any rank (or, the template dead, a SIGKILL with its
cause). Its status socket and pidfds are a :class:`_StatusChannel`, which
holds the rank's lease on its template until its exit is recorded.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import multiprocessing.reduction
import os
import pickle
import select
import signal
import socket
from collections.abc import Callable
from typing import Any

from aiospawn._core._log import logger
from aiospawn._rank.bootstrap import RankSetup
from aiospawn._rank.template import STATUS, FdCollector
from aiospawn._rank.wire import ChildEnd

from . import _pipes
from ._template import Template
from ._templates import hold, release


class _StatusChannel:
    """The supervisor's ends of one warm rank: its status socket and a pidfd (its ``_popen``).

    ``LocalRank`` closes a process's ``_popen`` once the rank is reaped.
    """

    def __init__(self, sock: socket.socket, pid: int, template: Template) -> None:
        self.sock = sock
        # The rank holds its template until its exit is recorded: never stopped as idle.
        self._template = template
        hold(template)
        self.fd = sock.fileno()
        sock.setblocking(False)
        self.pidfd: int | None = None
        with contextlib.suppress(OSError):
            self.pidfd = _pipes.track(os.pidfd_open(pid))
        #: The template's death, on a pidfd of our own (the template's may be
        #: closed by its stop() while the rank's exit is still being recorded).
        self._template_death: int | None = None
        #: What the rank's watcher waits on: the status socket, or the
        #: template's death. End-of-file alone cannot tell the template died:
        #: a rank forked after this one holds a copy of the template's end of
        #: this socket until it drops its siblings' ends (a preload's at-fork
        #: hook runs before that), and a rank that outlived the template keeps it.
        self.sentinel = self.fd
        self._either: select.epoll | None = None
        if template._pidfd is not None:
            self._template_death = _pipes.track(os.dup(template._pidfd))
            self._either = select.epoll()
            self._either.register(self.fd, select.EPOLLIN)
            self._either.register(self._template_death, select.EPOLLIN)
            self.sentinel = _pipes.track(self._either.fileno())
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
        return self.pidfd is None or _pipes.readable(self.pidfd)

    def template_died(self) -> bool:
        """True once the template has exited: then no status comes that is not queued already."""
        return self._template_death is not None and _pipes.readable(self._template_death)

    def close(self) -> None:
        """Release both ends. Idempotent."""
        if self.closed:
            return
        self.closed = True
        release(self._template)
        if self._either is not None:
            _pipes.forget(self.sentinel)
            self._either.close()
        _pipes.forget(self.fd)
        self.sock.close()
        if self._template_death is not None:
            _pipes.close(self._template_death)
            self._template_death = None
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
        #: The ready template to fork from, leased by the launcher before the start.
        self.template: Template | None = None
        self._template_pid: int | None = None
        #: What ended the rank, when its exit code alone would mislead.
        self.exit_cause: str | None = None

    def __repr__(self) -> str:
        state = "initial" if self.pid is None else ("started" if self._exitcode is None else "")
        code = "" if self._exitcode is None else f"exitcode={self._exitcode}"
        return f"<WarmProcess name={self.name!r} pid={self.pid} {state or code}>"

    @property
    def sentinel(self) -> int:
        """Readable once the template has sent the rank's exit status, or died."""
        return self._sentinel

    @property
    def exitcode(self) -> int | None:
        """The rank's exit code (``-signal`` if a signal ended it), once known."""
        channel = self._popen
        if self._exitcode is None and channel is not None and not channel.closed:
            # Before the status is read: a status the template sent before it
            # died is queued by the time its death shows.
            orphaned = channel.template_died()
            status = channel.read_status()
            if isinstance(status, int):
                self._exitcode = status
            elif (orphaned or isinstance(status, EOFError)) and channel.exited():
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
        """Fork the rank from its (ready) template. Blocking, briefly.

        Raises:
            TemplateError: As :meth:`Template.fork`.
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
        template = self.template
        assert template is not None, "the launcher leases the template first (acquire)"
        sock, self.pid = template.fork(payload, collector.fds)
        self._template_pid = template.pid
        self._popen = _StatusChannel(sock, self.pid, template)
        self._sentinel = self._popen.sentinel

    def is_alive(self) -> bool:
        """True between a successful start and the arrival of the exit status."""
        return self.pid is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the exit status. Blocking."""
        channel = self._popen
        if channel is None or channel.closed or self.exitcode is not None:
            return
        # After end-of-file, or once the template died, the sentinel is
        # always readable: wait for the process itself instead.
        orphaned = channel.eof or channel.template_died()
        watched = channel.pidfd if orphaned and channel.pidfd is not None else channel.sentinel
        # poll, not select: select() refuses descriptors numbered 1024 and up.
        poller = select.poll()
        poller.register(watched, select.POLLIN)
        with contextlib.suppress(InterruptedError):
            poller.poll(None if timeout is None else math.ceil(max(timeout, 0) * 1000))
        self.exitcode  # noqa: B018  (reads the status if it came)

    def close(self) -> None:
        """Release the status socket and pidfd; the exit code stays readable."""
        if self._popen is not None:
            self.exitcode  # noqa: B018
            self._popen.close()
