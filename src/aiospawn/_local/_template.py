"""Warm starts, seen from the supervisor: shared templates, and ranks forked from them.

With ``preload=[...]``, a group's ranks are not started by ``multiprocessing``:
each is forked by a template process that imported those modules once (the
template's own side, and the protocol, are in ``aiospawn._rank.template``).

- :class:`Template`: one template process, its control socket, its handshake.
- :func:`acquire` / :func:`release`: a group's start leases the template of
  its preload list, shared by every group of this process whose preload list,
  ``sys.path`` and environment agree; started on first use, started again if
  it died. A template's lease count is its starts under way and its ranks
  running; one with none is idle, and idle templates are stopped (see
  :data:`IDLE_TIMEOUT` and :data:`MAX_TEMPLATES`).
- :class:`WarmProcess`: what a :class:`~aiospawn._local._rank.LocalRank` holds
  in place of a ``multiprocessing`` process: ``start()`` asks its template to
  fork, ``sentinel`` becomes readable once the template reaped the rank (or
  died), and ``exitcode`` is then the status the template sent, exact as for
  any rank (or, the template dead, a SIGKILL with its cause).
- :func:`stop_all`: stop every template (at interpreter exit, and in tests).

A template's life, as a start sees it::

    acquire() ──► spawn (a worker thread: Process.start(), under the
                  template's own lock, never held across the import)
              ──► wait_ready() on the event loop: its control socket says
                  b"R" (ready) or b"E" (refused), or its pidfd says it died.
                  Cancellable: the import runs on in the template, and the
                  next start of the same key finds it, importing or ready.
              ──► fork() each rank (worker threads; the template answers at once)
    release() ──► idle once its ranks have ended too

The registry lock guards the table of templates and their lease counts only,
and is never held across anything that waits; so unrelated groups never wait
for each other's imports.
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
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio

from aiospawn._core._errors import describe_exit
from aiospawn._core._log import logger
from aiospawn._rank.bootstrap import RankSetup
from aiospawn._rank.template import MAX_FDS, PAYLOAD_SIZE, STATUS, FdCollector, serve
from aiospawn._rank.wire import ChildEnd

from . import _pipes

#: Seconds a template may take to exit once its control socket is closed.
STOP_PATIENCE = 5.0

#: Seconds after which an idle template (no start under way, no rank running)
#: is stopped, at the next warm start of this process.
IDLE_TIMEOUT = 300.0

#: The most templates this process keeps: beyond it, a warm start stops the
#: idle ones, the least recently used first (templates in use are never stopped).
MAX_TEMPLATES = 4


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
        """The template's exit code if it has exited (reaping it), else None."""
        if self._stopped:
            return self.exit_code
        try:
            return None if self.process is None else self.process.exitcode
        except ValueError:  # closed by stop() meanwhile, on another thread
            return self.exit_code

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
                await _wait_any(watched)
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
        await _run_to_completion(self.stop)  # for its exit code
        raise TemplateError(
            f"the warm-start template (pid {pid}) exited with"
            f" {_describe(self.exit_code)} while importing preload={list(self.key.preload)!r};"
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
        data = b""
        while len(data) < size:
            ready, _, _ = select.select([sock.fileno(), death], [], [])
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
        self.process.join(STOP_PATIENCE)
        return TemplateError(
            f"the warm-start template (pid {self.process.pid}) died"
            f" ({_describe(self.process.exitcode)}) before it could start the rank;"
            " the next start uses a new template"
        )


def _describe(exit_code: int | None) -> str:
    return "exit status unknown" if exit_code is None else describe_exit(exit_code)


async def _wait_any(fds: list[int]) -> None:
    """Wait until one of ``fds`` is readable."""
    async with anyio.create_task_group() as tg:

        async def wait(fd: int) -> None:
            await anyio.wait_readable(fd)
            tg.cancel_scope.cancel()

        for fd in fds:
            tg.start_soon(wait, fd)


async def _run_to_completion(blocking: Callable[[], object]) -> None:
    """Run ``blocking`` on a worker thread to its end, even if the caller is cancelled meanwhile."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(blocking)


#: Every template of this process, by key; and the lock of that table and of
#: each template's ``users`` and ``last_used``. Never held across a wait.
_templates: dict[TemplateKey, Template] = {}
_registry_lock = threading.Lock()


async def acquire(preload: tuple[str, ...]) -> Template:
    """Lease the ready template of ``preload`` for this process's ``sys.path`` and environment.

    Started if there is none, or if the last one died; idle templates are
    stopped on the way (see :data:`IDLE_TIMEOUT`, :data:`MAX_TEMPLATES`).
    Give the lease back with :func:`release` once the group's ranks are
    forked: each rank holds the template until its exit is recorded.

    Raises:
        TemplateError: As :meth:`Template.spawn` and :meth:`Template.wait_ready`;
            a template that failed is stopped before it is raised.

    Cancellation: returns once the template's process exists (a spawn is
    never abandoned half-way); its import goes on, unleased.
    """
    key = TemplateKey.current(preload)
    with _registry_lock:
        template = _templates.get(key)
        stale = _stale(key)
        if template is None or template in stale:
            template = _templates[key] = Template(key)
        template.users += 1
    try:
        if template.process is None or stale:
            await _run_to_completion(lambda: _prepare(template, stale))
        await template.wait_ready()
    except BaseException:
        release(template)
        if template.gone:
            with _registry_lock:
                if _templates.get(key) is template:
                    del _templates[key]
            await _run_to_completion(template.stop)
        raise
    return template


def release(template: Template) -> None:
    """Give back one lease of ``template`` (a start's, or a rank's once it ended)."""
    with _registry_lock:
        template.users -= 1
        template.last_used = time.monotonic()


def _hold(template: Template) -> None:
    """Take one more lease of ``template``: a rank forked from it."""
    with _registry_lock:
        template.users += 1


def _stale(key: TemplateKey) -> list[Template]:
    """Take out of the table the templates to stop: gone, or idle too long, or too many.

    Called under the registry lock; the template of ``key`` is kept unless it is gone.
    """
    now = time.monotonic()
    stale = []
    for other, template in list(_templates.items()):
        if template.gone:
            if template.pid is not None:
                logger.warning(
                    "warm-start template %s exited (%s)%s",
                    template.pid,
                    _describe(template.exit_status()),
                    "; starting a new one" if other == key else "",
                )
            stale.append(_templates.pop(other))
        elif other != key and template.users == 0 and now - template.last_used >= IDLE_TIMEOUT:
            stale.append(_templates.pop(other))
    idle = sorted(
        (t for k, t in _templates.items() if k != key and t.users == 0),
        key=lambda t: t.last_used,
    )
    excess = len(_templates) + (key not in _templates) - MAX_TEMPLATES
    for template in idle[: max(0, excess)]:
        stale.append(_templates.pop(template.key))
    return stale


def _prepare(template: Template, stale: list[Template]) -> None:
    """Spawn ``template`` (if need be), then stop ``stale``. Blocking: on a worker thread."""
    try:
        template.spawn()
    finally:
        for old in stale:
            logger.debug("stopping warm-start template %s (%r)", old.pid, old)
            old.stop()


def stop_all() -> None:
    """Stop every template of this process (at exit; tests call it between tests)."""
    with _registry_lock:
        templates = list(_templates.values())
        _templates.clear()
    for template in templates:
        template.stop()


atexit.register(stop_all)


def running_templates() -> list[int]:
    """The pids of this process's templates (for tests and diagnostics)."""
    with _registry_lock:
        return [t.pid for t in _templates.values() if t.pid is not None]


class _StatusChannel:
    """The supervisor's ends of one warm rank: its status socket and a pidfd (its ``_popen``).

    ``LocalRank`` closes a process's ``_popen`` once the rank is reaped.
    """

    def __init__(self, sock: socket.socket, pid: int, template: Template) -> None:
        self.sock = sock
        # The rank holds its template until its exit is recorded: never stopped as idle.
        self._template = template
        _hold(template)
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
        return self.pidfd is None or _readable(self.pidfd)

    def template_died(self) -> bool:
        """True once the template has exited: then no status comes that is not queued already."""
        return self._template_death is not None and _readable(self._template_death)

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


def _readable(fd: int) -> bool:
    ready, _, _ = select.select([fd], [], [], 0)
    return bool(ready)


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
        watched = [channel.pidfd] if orphaned and channel.pidfd is not None else [channel.sentinel]
        with contextlib.suppress(InterruptedError):
            select.select(watched, [], [], timeout)
        self.exitcode  # noqa: B018  (reads the status if it came)

    def close(self) -> None:
        """Release the status socket and pidfd; the exit code stays readable."""
        if self._popen is not None:
            self.exitcode  # noqa: B018
            self._popen.close()
