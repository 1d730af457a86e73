"""The rank bootstrap: what runs in a rank's process around ``fn(rank, *args)``.

``multiprocessing`` calls :func:`run_rank` in the new process. Before ``fn``
runs, the rank

1. becomes the leader of its own process group, so that a terminal's Ctrl-C
   reaches the supervisor, which decides, and so that a shutdown signal also
   reaches the rank's own children;
2. gets Python's default signal handling back (a ``fork`` start inherits the
   supervisor's event-loop handlers, wakeup fd and the starting thread's mask);
3. starts a guard thread that kills the rank's process group as soon as the
   supervising process is gone, however it died. It waits on a pidfd of the
   supervising *process*, unlike ``PR_SET_PDEATHSIG``, which fires when the
   thread that forked the rank exits (prctl(2)) and so cannot be used from
   worker threads that retire;
4. becomes the subreaper of its descendants (see ``descendants``), so that a
   process it starts stays in its tree even after leaving its process group
   or session, or being orphaned by a double fork.

Then, for a ``fn`` sent by value, the rank unpickles it and ``args`` (see
:func:`unpickle_in_rank`), and ``fn`` runs. When it ends (returns, raises or
calls ``sys.exit()``), every process it started that still runs is SIGKILLed,
wherever it went, and only then is its outcome sent back as one frame (see
``wire``): a rank's leftover processes end with the rank. (When the supervisor
dies, the guard kills them too.)
The exit-code contract, row by row:

=====================================  ================  ==========================
``fn`` ...                             exit code         the supervisor reports
=====================================  ================  ==========================
returns ``value``                      0                 success, result ``value``
calls ``sys.exit()`` / ``sys.exit(0)`` 0                 success, result ``None``
calls ``sys.exit(n)``, n != 0          n                 ProcessExitedException
calls ``sys.exit("text")``             1                 ProcessExitedException
                                                         with the text
raises (``KeyboardInterrupt`` too)     1                 ProcessRaisedException
returns an unpicklable value           1                 ProcessRaisedException
                                                         saying so
calls ``os._exit(0)``                  0                 success, result ``None``
calls ``os._exit(n)``, n != 0          n                 ProcessExitedException
is killed by a signal                  -signal           ProcessExitedException
=====================================  ================  ==========================

This module runs before the user's code in every rank, so it imports the
standard library only, and nothing that the supervisor needs (no anyio,
no asyncio): a rank costs the interpreter plus the user's own imports.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from . import api, descendants
from .wire import (
    BEAT_BYTES,
    STACK_SIGNAL,
    ChildEnd,
    Kind,
    encode_exception,
    encode_exit,
    encode_value,
    from_fn,
    header,
)


class _EarlyEnvironment(str):
    """A process name that sets the rank's environment as it is unpickled.

    Under ``spawn`` and ``forkserver`` the new process unpickles the name
    (with the rest of its preparation data) before it imports the main
    module and ``fn``'s module, so the variables are in place for them. That
    is also before ``sys.path`` is set up, so the unpickling may only use the
    standard library: it evaluates one fixed expression over the variables.

    With ``main``, the expression also gives the rank's ``__main__`` that
    ``__file__``: multiprocessing then takes the main module as already
    loaded instead of running it again from a path that is no file (a
    script read from standard input has ``__file__ == "<stdin>"``, and its
    ranks died in ``FileNotFoundError`` before our code ran). Such a rank's
    ``fn`` comes by value, so it needs nothing of that ``__main__``.
    """

    env: dict[str, str]
    main: str | None

    def __reduce__(self) -> tuple[Any, ...]:
        return eval, (_SET_ENVIRONMENT, {"env": self.env, "main": self.main, "name": str(self)})


_SET_ENVIRONMENT = (
    "__import__('os').environ.update(env)"
    " or main is not None and setattr(__import__('sys').modules['__main__'], '__file__', main)"
    " or name"
)


def early_environment(name: str, env: dict[str, str] | None, main: str | None = None) -> str:
    """``name``, which also carries ``env`` (and ``main``) into a rank before its imports.

    See :class:`_EarlyEnvironment`. Only for ``spawn`` and ``forkserver``
    ranks: a ``fork`` rank keeps its name unpickled, and any process that
    unpickled it later (a log record's ``processName``) would take the
    variables too.
    """
    if not env and main is None:
        return name
    carrier = _EarlyEnvironment(name)
    carrier.env = env or {}
    carrier.main = main
    return carrier


class Payload:
    """``fn`` and ``args`` of a ``spawn`` or ``forkserver`` rank, as the supervisor pickled them.

    Made by :func:`unpickle_now` or :func:`unpickle_in_rank`, which the
    supervisor's pickle names (see ``_local._launcher``).
    """

    __slots__ = ("_data", "_work")

    def __init__(
        self, data: bytes | None, work: tuple[Callable[..., Any], tuple[Any, ...]] | None
    ) -> None:
        self._data = data
        self._work = work

    def load(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Return ``(fn, args)``, unpickling them if that has not happened yet."""
        if self._work is None:
            assert self._data is not None
            fn, args = pickle.loads(self._data)
            self._work, self._data = (fn, args), None
        return self._work


def unpickle_now(data: bytes) -> Payload:
    """By reference: unpickled with the process object, as multiprocessing does.

    That is while the supervisor's ``Process.start()`` still waits, once the
    environment and ``__main__`` are in place, and it imports ``fn``'s module.
    """
    fn, args = pickle.loads(data)
    return Payload(None, (fn, args))


def unpickle_in_rank(data: bytes) -> Payload:
    """By value (cloudpickle): unpickled by :func:`run_rank`, before ``fn`` runs.

    Then the guard runs and the streams are redirected, and a failure is
    reported as one of ``fn`` (a module the rank lacks, say). Plain
    ``pickle.loads`` reads it, and imports cloudpickle, in those ranks only.
    """
    return Payload(data, None)


class RankSetup(NamedTuple):
    """What the supervisor tells a rank about its surroundings.

    Attributes:
        supervisor_pid: The supervising process, whose death kills this rank.
        supervisor_is_parent: True under ``spawn`` and ``fork``; under
            ``forkserver`` the fork server is the parent.
        env: Variables to set in ``os.environ`` before ``fn`` runs.
        stdout: Where fd 1 goes: the write end of a pipe to the supervisor, a
            file path (created owner-only), or ``None`` to inherit.
        stderr: The same for fd 2.
        restart: How many times this rank has been restarted.
        heartbeat: A memory file holding the rank's heartbeat slot, when the
            group watches heartbeats.
        stacks: Where the rank writes its threads' stacks on
            :data:`~aiospawn._rank.wire.STACK_SIGNAL`, when the group watches heartbeats.
    """

    supervisor_pid: int
    supervisor_is_parent: bool
    env: dict[str, str] | None = None
    stdout: ChildEnd | str | None = None
    stderr: ChildEnd | str | None = None
    restart: int = 0
    heartbeat: ChildEnd | None = None
    stacks: ChildEnd | None = None


def run_rank(
    fn: Callable[..., Any] | Payload,
    rank: int,
    args: tuple[Any, ...],
    channel: ChildEnd,
    setup: RankSetup,
) -> None:
    """Run ``fn(rank, *args)`` as rank ``rank`` and report how it ended.

    Args:
        fn: The user's function, or a :class:`Payload` holding it and ``args``.
        rank: This rank's index.
        args: The extra positional arguments (empty with a :class:`Payload`).
        channel: Write end of the rank's private result pipe.
        setup: The rank's surroundings.
    """
    _become_group_leader()
    descendants.become_subreaper()
    _restore_default_signals()
    _guard_supervisor(setup.supervisor_pid, setup.supervisor_is_parent)
    if setup.env:  # a fork start has not set them yet
        os.environ.update(setup.env)
    api._restart = setup.restart
    api._beat = None  # a fork of a rank that beats must not beat into its parent's slot
    if setup.heartbeat is not None and setup.stacks is not None:
        _watch_progress(setup.heartbeat, setup.stacks)
    _redirect(sys.stdout, 1, setup.stdout)
    _redirect(sys.stderr, 2, setup.stderr)
    fd = channel.fd
    try:
        if isinstance(fn, Payload):
            fn, args = fn.load()
        value = fn(rank, *args)
    except SystemExit as exc:
        kind, payload, code = encode_exit(exc)
        _report(fd, kind, payload)
        if code:
            raise  # multiprocessing turns it into the exit code (and prints a text code)
        return
    except BaseException as exc:
        _report(fd, Kind.RAISED, encode_exception(from_fn(exc)))
        raise SystemExit(1) from None
    kind, payload, code = encode_value(value)
    _report(fd, kind, payload)
    if code:
        raise SystemExit(code) from None


#: Seconds a rank waits, once ``fn`` ended, for its leftover processes to die
#: of SIGKILL (only one stuck in the kernel takes that long).
LEFTOVER_PATIENCE = 5.0


def _report(fd: int, kind: int, payload: bytes) -> None:
    # Leftovers first: once the supervisor has the outcome, the rank's
    # processes are gone, even those that left its process group.
    descendants.kill_descendants(os.getpid(), LEFTOVER_PATIENCE)
    _send(fd, kind, payload)


def _watch_progress(heartbeat: ChildEnd, stacks: ChildEnd) -> None:
    import mmap  # only in ranks that beat

    shared = mmap.mmap(heartbeat.fd, BEAT_BYTES)
    os.close(heartbeat.fd)
    beat = api._beat = memoryview(shared).cast("q")
    import faulthandler  # built in: no file to load

    # Written from the signal handler, in C: it works while Python code spins
    # or sleeps. The supervisor removes the guard thread's own stack.
    faulthandler.register(STACK_SIGNAL, file=stacks.fd, all_threads=True, chain=False)
    beat[1] = 1  # ready for stack requests


def _redirect(stream: Any, fd: int, target: ChildEnd | str | None) -> None:
    # At the descriptor level, so that C extensions and the rank's own children
    # write there too.
    if target is None:
        return
    if stream is not None:
        stream.flush()
    if isinstance(target, str):
        new = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(new, fd)
        os.close(new)
    else:
        os.dup2(target.fd, fd)
        os.close(target.fd)
        # Lines reach the supervisor as they are written, as with python -u.
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


def _become_group_leader() -> None:
    with contextlib.suppress(OSError):  # already a session or group leader
        os.setpgid(0, 0)


def _restore_default_signals() -> None:
    # A fork inherits the supervisor's Python handlers and the wakeup fd of its
    # event loop: a signal in the rank would otherwise run the supervisor's
    # handlers or write into its loop. A spawn child inherits ignored
    # dispositions (a background job ignores SIGINT). SIGPIPE stays ignored,
    # as in any Python program.
    signal.set_wakeup_fd(-1)
    for signum in range(1, signal.NSIG):  # plain ints: Signals enums cost a rank's start-up
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(signum)
        except ValueError:  # reserved by the C library
            continue
        if signum == signal.SIGINT:
            wanted: Any = signal.default_int_handler
        elif signum == signal.SIGTERM or callable(handler):
            wanted = signal.SIG_DFL
        else:
            continue
        if handler is not wanted:
            signal.signal(signum, wanted)
    # The mask of the thread that forked us survives fork and exec.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _guard_supervisor(supervisor_pid: int, supervisor_is_parent: bool) -> None:
    # Watch the supervisor itself, not our parent: under forkserver the parent
    # is the fork server, which cannot exit while its children hold its
    # "alive" pipe, so waiting for it would keep both alive forever.
    if supervisor_is_parent and os.getppid() != supervisor_pid:
        _kill_own_group()  # it died while this rank was starting
    try:
        supervisor_fd: int | None = os.pidfd_open(supervisor_pid)
    except ProcessLookupError:
        _kill_own_group()
    except (AttributeError, OSError):  # no pidfd: not Linux, or Linux < 5.3
        supervisor_fd = None
    if supervisor_is_parent and os.getppid() != supervisor_pid:
        _kill_own_group()  # it died before pidfd_open(): the pid may be reused
    # The guard must never take a signal meant for the rank: the kernel may
    # deliver a process-directed signal to any thread that does not block it,
    # and Python runs handlers in the main thread only, which would then sleep
    # on. The new thread inherits the mask in force when it is created.
    # (A bare thread: threading.Thread's start-up handshake costs every rank.)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        _thread.start_new_thread(_die_with_supervisor, (supervisor_pid, supervisor_fd))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _die_with_supervisor(supervisor_pid: int, supervisor_fd: int | None) -> None:
    if supervisor_fd is None:
        while _exists(supervisor_pid):
            time.sleep(0.5)
    else:
        poller = select.poll()
        poller.register(supervisor_fd, select.POLLIN)
        while not poller.poll():  # readable once the supervisor process has exited
            pass
    _kill_own_group()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_own_group() -> None:
    # The process group holds this rank and the children it started, unless
    # they moved out; those that did are still descendants of this subreaper.
    # A rank that is not a group leader kills only its descendants and itself.
    with contextlib.suppress(OSError):
        descendants.kill_descendants(os.getpid(), patience=1.0)
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _send(fd: int, kind: int, payload: bytes) -> None:
    try:
        _write_all(fd, header(kind, len(payload)))
        _write_all(fd, payload)
    except OSError:  # the supervisor is gone; the exit code still tells the story
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
