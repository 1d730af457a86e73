"""The rank bootstrap: what runs in a rank's process around ``fn(rank, *args)``.

(About 580 lines, one idea: everything a rank's process does around ``fn``,
in order; it runs before any user code, so it stays one standard-library
module that a rank imports alone.)

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
:func:`unpickle_in_rank`), and ``fn`` runs: an ``async def fn`` on a new event
loop of the kind ``RankSetup.loop`` names (see :func:`_run_async`), imported
only then. The rank's end of its channel (``channel``) is set up before.
When ``fn`` ends (returns, raises or calls ``sys.exit()``), every process it
started that still runs is SIGKILLed, wherever it went, then what a cancelled
send left on the channel goes out, and only then is its outcome sent back as
one frame (see ``wire``): a rank's leftover processes end with the rank. (When the supervisor
dies, the guard kills them too.)
The exit-code contract, row by row:

=====================================  ================  ==========================
``fn`` ...                             exit code         the supervisor reports
=====================================  ================  ==========================
returns ``value``                      0                 success, result ``value``
calls ``sys.exit()`` / ``sys.exit(0)`` 0                 success, result ``None``
calls ``sys.exit(n)``, 0 < n < 256     n                 ProcessExitedException
calls ``sys.exit(n)``, other n         1                 ProcessExitedException,
                                                         ``exit_code`` n (for n > 0)
                                                         and ``sys.exit(n)`` in the
                                                         message
calls ``sys.exit("text")``             1                 ProcessExitedException
                                                         with the text
raises (``KeyboardInterrupt`` too)     1                 ProcessRaisedException
returns an unpicklable value           1                 ProcessRaisedException
                                                         saying so
closes the pipe it reports on and      86 (or fn's own   ProcessExitedException
then ends (``os.closerange``)          non-zero code)    saying the outcome is lost
calls ``os._exit(0)``                  0                 success, result ``None``
calls ``os._exit(n)``, n != 0          n                 ProcessExitedException
is killed by a signal                  -signal           ProcessExitedException
is an ``async def`` cancelled by       -SIGTERM          ProcessExitedException
SIGTERM (its cleanup has run)                            (stopped by us)
=====================================  ================  ==========================

After ``fn``, the rank never returns into ``multiprocessing``, under any
start method. Under ``fork`` and ``forkserver`` what called the bootstrap is
a copy of the supervisor (or of the fork server), whose code must not run
again in the rank; under ``spawn`` a return ends in the interpreter's
finalization, where extension libraries' C++ static destructors may abort a
rank whose ``fn`` has finished. So every rank runs Python's exit steps
itself (non-daemon threads joined, the atexit handlers registered in the
rank, ``multiprocessing``'s finalizers, stdio flushed) and ends with
``os._exit`` (see :func:`_exit_steps`): a rank that finished reads as
finished. Not run: the interpreter's finalization (``__del__`` of what is
still alive, module teardown) and C-level exit handlers. The status is one
the kernel keeps as it is (0 to 255).

What a rank holds of the supervisor's descriptors: under ``spawn`` and
``forkserver``, only what it is handed. A ``fork`` rank is a copy of the
supervisor and starts with its whole descriptor table; the bootstrap closes
those aiospawn opened for supervision (its siblings' pipes, heartbeat memory
and pidfds, log directories), the event loop's epoll and the write end of its
signal wakeup pipe. Every other inherited descriptor is left open: it belongs
to the program the rank was forked from (a ``multiprocessing.Pipe`` in
``args``, a log file), which ``fn`` may use. The rank's own descriptors (the
result pipe, the stack pipe, the pidfd the guard watches) are moved to
numbers of at least :data:`HIGH_FD`, away from the low numbers that code
reuses or closes; a guard that finds its pidfd closed opens another.

This module runs before the user's code in every rank, so it imports the
standard library only, and nothing that the supervisor needs (no anyio,
no asyncio): a rank costs the interpreter plus the user's own imports.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half; typeshed has no stub
import _thread
import contextlib
import operator
import os
import pickle
import select
import signal
import stat
import sys
import time
from collections.abc import Coroutine

from . import api, descendants
from .channel import finish as finish_channel
from .channel import open_channel
from .wire import (
    BEAT_BYTES,
    LOST_CHANNEL_STATUS,
    STACK_SIGNAL,
    ChildEnd,
    Kind,
    encode_exception,
    encode_exit,
    encode_value,
    ended_frame,
    from_fn,
    header,
)

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, NoReturn


class _EarlyEnvironment(str):
    """A process name that sets the rank's environment as it is unpickled.

    Under ``spawn`` and ``forkserver`` the new process unpickles the name
    (with the rest of its preparation data) before it imports the main
    module and ``fn``'s module, so the variables are in place for them. That
    is also before ``sys.path`` is set up, so the unpickling may only call
    the standard library: it unpickles as calls of built-ins on ``os`` and
    ``sys`` (see :class:`_Call`), never as code to compile, which every rank
    would pay for.

    With ``main``, it also gives the rank's ``__main__`` that ``__file__``:
    multiprocessing then takes the main module as already loaded instead of
    running it again from a path that is no file (a script read from
    standard input has ``__file__ == "<stdin>"``, and its ranks died in
    ``FileNotFoundError`` before our code ran). Such a rank's ``fn`` comes by
    value, so it needs nothing of that ``__main__``.
    """

    env: dict[str, str]
    main: str | None

    def __reduce__(self) -> tuple[Any, ...]:
        environ = _Call(getattr, _Call(__import__, "os"), "environ")
        steps: list[Any] = [_Call(operator.methodcaller("update", self.env), environ)]
        if self.main is not None:
            modules = _Call(getattr, _Call(__import__, "sys"), "modules")
            main_module = _Call(operator.getitem, modules, "__main__")
            steps.append(_Call(setattr, main_module, "__file__", self.main))
        # The steps are unpickled (so called) in order, then the name is the value.
        return operator.getitem, ((*steps, str(self)), -1)


class _Call:
    """Unpickles as ``fn(*args)``, called by the unpickler; an argument may be a ``_Call`` too.

    Only ``fn`` and ``args`` travel: unpickling needs nothing of ours.
    """

    __slots__ = ("_call",)

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._call = (fn, args)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._call


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


class RankSetup:
    """What the supervisor tells a rank about its surroundings (pickled to it under ``spawn``).

    A plain class, not a ``NamedTuple``: building a named tuple's class imports
    ``typing`` and compiles each annotation, which every ``spawn`` rank paid.

    Attributes:
        supervisor_pid: The supervising process, whose death kills this rank.
        supervisor_is_parent: True under ``spawn`` and ``fork``; under
            ``forkserver`` the fork server is the parent.
        env: Variables to set in ``os.environ`` before ``fn`` runs.
        stdout: Where fd 1 goes: the write end of a pipe to the supervisor, a
            file the supervisor opened, ``os.devnull``, or ``None`` to inherit.
        stderr: The same for fd 2.
        restart: How many times this rank has been restarted.
        heartbeat: A memory file holding the rank's heartbeat slot, when the
            group watches heartbeats.
        stacks: Where the rank writes its threads' stacks on
            :data:`~aiospawn._rank.wire.STACK_SIGNAL`, when the group watches heartbeats.
        start_method: How the rank's process was made.
        inherited: Under ``fork`` only: the descriptors the supervisor holds
            for its ranks, each with the ``(st_dev, st_ino)`` of its file, as
            they were when this rank was forked (a fork copies the mapping).
        channel: The rank's end of its channel to the supervisor (a socket).
        loop: The event loop an ``async def fn`` runs on: ``"asyncio"``,
            ``"trio"`` or ``"uvloop"``.
    """

    __slots__ = (
        "channel",
        "env",
        "heartbeat",
        "inherited",
        "loop",
        "restart",
        "stacks",
        "start_method",
        "stderr",
        "stdout",
        "supervisor_is_parent",
        "supervisor_pid",
    )

    def __init__(
        self,
        *,
        supervisor_pid: int,
        supervisor_is_parent: bool,
        env: dict[str, str] | None = None,
        stdout: ChildEnd | str | None = None,
        stderr: ChildEnd | str | None = None,
        restart: int = 0,
        heartbeat: ChildEnd | None = None,
        stacks: ChildEnd | None = None,
        start_method: str = "spawn",
        inherited: Mapping[int, tuple[int, int]] | None = None,
        channel: ChildEnd | None = None,
        loop: str = "asyncio",
    ) -> None:
        self.supervisor_pid = supervisor_pid
        self.supervisor_is_parent = supervisor_is_parent
        self.env = env
        self.stdout = stdout
        self.stderr = stderr
        self.restart = restart
        self.heartbeat = heartbeat
        self.stacks = stacks
        self.start_method = start_method
        self.inherited = inherited
        self.channel = channel
        self.loop = loop

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"RankSetup({fields})"


#: A rank's own descriptors are moved to this number or above.
HIGH_FD = 100


def run_rank(
    fn: Callable[..., Any] | Payload,
    rank: int,
    args: tuple[Any, ...],
    channel: ChildEnd,
    setup: RankSetup,
) -> NoReturn:
    """Run ``fn(rank, *args)`` as rank ``rank``, report how it ended, and end the process.

    Args:
        fn: The user's function, or a :class:`Payload` holding it and ``args``.
        rank: This rank's index.
        args: The extra positional arguments (empty with a :class:`Payload`).
        channel: Write end of the rank's private result pipe.
        setup: The rank's surroundings.
    """
    status = 1  # whatever interrupts what follows, the rank cannot read as a success
    try:
        report = _Channel(channel)
        try:
            _prepare(setup, report)
        except BaseException as exc:
            report.send(Kind.RAISED, encode_exception(exc), time.time())
            raise
        text = None
        terminated = False
        try:
            try:
                if isinstance(fn, Payload):  # sent by value: unpickled now, after env
                    fn, args = fn.load()
                value = fn(rank, *args)
                if isinstance(value, Coroutine):  # an async def fn: run it on its own loop
                    value = _run_async(value, setup.loop)
            finally:
                # When fn ended, on the rank's clock: the supervisor orders
                # failures by it, however late it learns of them.
                ended_at = time.time()
        except _Terminated:
            terminated = True
        except SystemExit as exc:
            kind, payload, code = encode_exit(exc)
            if exc.code is not None and not isinstance(exc.code, int):
                text = str(exc.code)  # printed, as Python does for sys.exit("text")
        except BaseException as exc:
            kind, payload, code = Kind.RAISED, encode_exception(from_fn(exc)), 1
        else:
            kind, payload, code = encode_value(value)
        # Leftovers first: once the supervisor has the outcome, the rank's
        # processes are gone, even those that left its process group.
        descendants.kill_descendants(os.getpid(), LEFTOVER_PATIENCE)
        # Then what the rank sent and a cancellation left queued.
        finish_channel(api._frames, LEFTOVER_PATIENCE)
        if terminated:
            _die_of_sigterm()
        # Only once the frame is out may the status become 0: a KeyboardInterrupt
        # while it is written must not leave a success without a result.
        status = code if report.send(kind, payload, ended_at) or code else LOST_CHANNEL_STATUS
        if text is not None:
            print(text, file=sys.stderr)
    finally:
        _end(status)


class _Channel:
    """The rank's end of its result pipe, kept out of the way of ``fn``'s own descriptors."""

    def __init__(self, end: ChildEnd) -> None:
        self.fd = _move_high(end.fd)
        self._identity = _identity(self.fd)

    def send(self, kind: int, payload: bytes, ended_at: float) -> bool:
        """Write the frame after when ``fn`` ended; False if ``fn`` closed or replaced the pipe."""
        if _identity(self.fd) != self._identity:
            # Closed (os.closerange), or the number now holds another file of
            # the rank's: writing there would corrupt that file.
            _say(
                f"the pipe on which this rank reports how fn ended (fd {self.fd}) was"
                " closed by the rank's own code: its outcome is lost"
            )
            return False
        try:
            _write_all(self.fd, ended_frame(ended_at) + header(kind, len(payload)))
            _write_all(self.fd, payload)
        except OSError:  # the supervisor is gone; the exit code still tells the story
            pass
        return True


def _prepare(setup: RankSetup, report: _Channel) -> None:
    if setup.start_method != "spawn":
        # A copy of the supervisor (or of the fork server, or a template):
        # the atexit handlers it holds are that process's, never the rank's.
        # The rank's end runs those registered from here on (see _exit_steps).
        import atexit

        atexit._clear()
    _become_group_leader()
    descendants.become_subreaper()
    wakeup_fd = _restore_default_signals()
    if setup.inherited is not None:
        own = [
            report.fd,
            *((setup.channel.fd,) if setup.channel is not None else ()),
            *(end.fd for end in (setup.stdout, setup.stderr) if isinstance(end, ChildEnd)),
            *(end.fd for end in (setup.heartbeat, setup.stacks) if end is not None),
        ]
        _close_supervisor_fds(setup.inherited, set(own), wakeup_fd)
        _forget_supervisor_loop()
    _guard_supervisor(setup.supervisor_pid, setup.supervisor_is_parent)
    if setup.env:  # a fork start has not set them yet
        os.environ.update(setup.env)
    api._restart = setup.restart
    api._beat = None  # a fork of a rank that beats must not beat into its parent's slot
    api._channel, api._ready, api._loop = None, False, None  # nor talk on its channel
    api._frames = None if setup.channel is None else open_channel(_move_high(setup.channel.fd))
    if setup.heartbeat is not None and setup.stacks is not None:
        _watch_progress(setup.heartbeat, setup.stacks)
    _redirect(sys.stdout, 1, setup.stdout)
    _redirect(sys.stderr, 2, setup.stderr)


def _forget_supervisor_loop() -> None:
    """In a ``fork`` rank: forget the supervisor's trio loop, which this thread was running.

    A fork copies the forking thread's thread-locals, and the supervisor forks
    on its event-loop thread. trio keeps its running loop there (``trio.run()``
    would refuse: "called from inside a run()"), and sniffio the name of the
    running library (so anyio in an asyncio rank would take it for trio).
    asyncio needs nothing: it checks the pid of its running loop.
    Looked up in ``sys.modules``: a rank that never imported them has nothing to forget.
    """
    trio_run = sys.modules.get("trio._core._run")
    if trio_run is not None:
        for name in ("runner", "task"):
            with contextlib.suppress(AttributeError):
                delattr(trio_run.GLOBAL_RUN_CONTEXT, name)
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None:
        sniffio.thread_local.name = None
        sniffio.current_async_library_cvar.set(None)


class _Terminated(BaseException):
    """SIGTERM cancelled an ``async def fn``, which has run its cleanup."""


def _run_async(main: Coroutine[Any, Any, Any], loop: str) -> Any:
    """Run the coroutine of an ``async def fn`` on a new event loop; SIGTERM cancels it.

    The first SIGTERM cancels the rank's main task, so its ``finally`` blocks
    and ``async with`` exits run, and puts back the default action: a second
    SIGTERM ends the rank at once. Once the task has unwound, the rank ends
    as killed by SIGTERM (see :func:`_die_of_sigterm`), as a sync rank would.

    Raises:
        _Terminated: SIGTERM cancelled the task (whatever it returned then).
    """
    api._loop = "trio" if loop == "trio" else "asyncio"
    terminated: list[bool] = []
    if loop == "trio":
        import trio

        value = trio.run(_trio_main, main, terminated)
    else:
        import asyncio

        factory = None
        if loop == "uvloop":
            import importlib

            factory = importlib.import_module("uvloop").new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            value = runner.run(_asyncio_main(main, terminated))
    if terminated:
        raise _Terminated
    return value


async def _asyncio_main(main: Coroutine[Any, Any, Any], terminated: list[bool]) -> Any:
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_sigterm() -> None:
        terminated.append(True)
        loop.remove_signal_handler(signal.SIGTERM)  # back to the default: a second one kills
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await main
    except asyncio.CancelledError:
        if not terminated:
            raise
        return None
    finally:
        if not terminated:
            loop.remove_signal_handler(signal.SIGTERM)


async def _trio_main(main: Coroutine[Any, Any, Any], terminated: list[bool]) -> Any:
    import trio

    token = trio.lowlevel.current_trio_token()
    value = None
    with trio.CancelScope() as scope:

        def on_sigterm(signum: int, frame: Any) -> None:
            terminated.append(True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one kills
            token.run_sync_soon(scope.cancel)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            value = await main
        finally:
            if not terminated:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return value


def _die_of_sigterm() -> NoReturn:
    """End the rank as killed by SIGTERM, its output flushed, as a stopped sync rank ends."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))
    os.kill(os.getpid(), signal.SIGTERM)
    while True:  # delivered at once to this thread; never past this
        signal.pause()


def _end(status: int) -> NoReturn:
    """End the rank with ``status`` once Python's exit steps have run (see :func:`_exit_steps`).

    Never by returning into ``multiprocessing``: under ``fork`` and
    ``forkserver`` its caller is a copy of the supervisor or of the fork
    server, and under ``spawn`` a return ends in the interpreter's
    finalization, where C++ static destructors of extension libraries may
    abort a rank whose ``fn`` has finished (reported of two-rank gloo DDP
    jobs with torch 2.13).
    """
    try:
        _exit_steps()
    finally:
        os._exit(status)


def _exit_steps() -> None:
    """What a Python program runs at its end, short of the interpreter's finalization.

    In the order Python runs them: the wait for non-daemon threads, then the
    atexit handlers registered in the rank (the inherited ones were dropped
    at its start, see :func:`_prepare`), then ``multiprocessing``'s exit
    function, which a rank's ``multiprocessing`` child runs at its end (its
    finalizers: a Queue's feeder thread flushes what was put; its children
    are joined), then the streams are flushed: ``sys.stdout`` and
    ``sys.stderr`` (and the originals, ``sys.__stdout__`` and
    ``sys.__stderr__``), and the C library's, when ``ctypes`` is loaded. A step
    that raises is printed, as Python prints it, and the next one runs.
    """
    import atexit
    import threading
    from multiprocessing import util

    steps = (
        threading._shutdown,  # type: ignore[attr-defined]
        atexit._run_exitfuncs,  # prints what a handler raises, and goes on
        util._exit_function,  # type: ignore[attr-defined]
    )
    for step in steps:
        try:
            step()
        except BaseException:
            with contextlib.suppress(BaseException):
                import traceback

                traceback.print_exc()
    # The original streams too: code that replaced sys.stdout (a fork rank of
    # a program that captures its output) leaves them in use, unflushed.
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    ctypes = sys.modules.get("ctypes")
    if ctypes is not None:
        # What a C extension printed with stdio and left in its buffer (a
        # pipe or a file is fully buffered): exit(3) would flush it, _exit(2)
        # does not. Only when ctypes is loaded already: importing it would
        # cost every rank's end a few milliseconds.
        with contextlib.suppress(BaseException):
            ctypes.CDLL(None).fflush(None)


def _move_high(fd: int) -> int:
    """Move ``fd`` to :data:`HIGH_FD` or above (close-on-exec); keep it if that fails."""
    import fcntl

    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD)
    except OSError:  # RLIMIT_NOFILE at or below HIGH_FD
        return fd
    os.close(fd)
    return high


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _close_supervisor_fds(
    inherited: Mapping[int, tuple[int, int]], own: set[int], wakeup_fd: int
) -> None:
    # The descriptors aiospawn holds for its ranks, checked against the file
    # each held when it was opened: a number closed since then may hold
    # another file of the program now, which is not ours to close.
    for fd, identity in list(inherited.items()):
        if fd not in own and _identity(fd) == identity:
            os.close(fd)
    if wakeup_fd >= 0 and wakeup_fd not in own:
        # The write end of the supervisor's event-loop wakeup pipe.
        with contextlib.suppress(OSError):
            os.close(wakeup_fd)
    # The event loop's epoll, and the descriptor that each heartbeat mapping
    # of the supervisor holds (mmap keeps a duplicate): neither is in the
    # table above, both are found by what they are.
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc
        return
    for name in names:
        fd = int(name)
        if fd in own:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target == "anon_inode:[eventpoll]" or target.startswith("/memfd:aiospawn-heartbeat"):
            with contextlib.suppress(OSError):
                os.close(fd)


#: Seconds a rank waits, once ``fn`` ended, for its leftover processes to die
#: of SIGKILL (only one stuck in the kernel takes that long).
LEFTOVER_PATIENCE = 5.0


def _watch_progress(heartbeat: ChildEnd, stacks: ChildEnd) -> None:
    import mmap  # only in ranks that beat

    shared = mmap.mmap(heartbeat.fd, BEAT_BYTES)
    os.close(heartbeat.fd)
    beat = api._beat = memoryview(shared).cast("q")
    import faulthandler  # built in: no file to load

    # Written from the signal handler, in C: it works while Python code spins
    # or sleeps. The supervisor removes the guard thread's own stack.
    faulthandler.register(STACK_SIGNAL, file=_move_high(stacks.fd), all_threads=True, chain=False)
    beat[1] = 1  # ready for stack requests


def _redirect(stream: Any, fd: int, target: ChildEnd | str | None) -> None:
    # At the descriptor level, so that C extensions and the rank's own children
    # write there too.
    if target is None:
        return
    if stream is not None:
        stream.flush()
    if isinstance(target, str):  # os.devnull
        new = os.open(target, os.O_WRONLY)
        os.dup2(new, fd)
        os.close(new)
        return
    to_us = stat.S_ISFIFO(os.fstat(target.fd).st_mode)  # else a file the supervisor opened
    os.dup2(target.fd, fd)
    os.close(target.fd)
    if to_us and stream is not None and hasattr(stream, "reconfigure"):
        # Lines reach the supervisor as they are written, as with python -u.
        stream.reconfigure(line_buffering=True)


def _become_group_leader() -> None:
    with contextlib.suppress(OSError):  # already a session or group leader
        os.setpgid(0, 0)


def _restore_default_signals() -> int:
    # A fork inherits the supervisor's Python handlers and the wakeup fd of its
    # event loop: a signal in the rank would otherwise run the supervisor's
    # handlers or write into its loop. A spawn child inherits ignored
    # dispositions (a background job ignores SIGINT). SIGPIPE stays ignored,
    # as in any Python program.
    # Through _signal, the C module under signal: the signal module wraps each
    # handler and signal number it returns in an enum, and in a fork rank
    # those conversions took about 1 ms of the start (0.1 ms without them).
    wakeup_fd: int = _signal.set_wakeup_fd(-1)
    for signum in range(1, _signal.NSIG):
        if signum in (_signal.SIGKILL, _signal.SIGSTOP):
            continue
        try:
            handler = _signal.getsignal(signum)
        except ValueError:  # reserved by the C library
            continue
        if signum == _signal.SIGINT:
            wanted: Any = _signal.default_int_handler
        elif signum == _signal.SIGTERM or callable(handler):
            wanted = _signal.SIG_DFL
        else:
            continue
        if handler != wanted:
            _signal.signal(signum, wanted)
    # The mask of the thread that forked us survives fork and exec.
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
    return wakeup_fd


def _guard_supervisor(supervisor_pid: int, supervisor_is_parent: bool) -> None:
    # Watch the supervisor itself, not our parent: under forkserver the parent
    # is the fork server, which cannot exit while its children hold its
    # "alive" pipe, so waiting for it would keep both alive forever.
    watched = _open_supervisor(supervisor_pid, supervisor_is_parent)
    # The guard must never take a signal meant for the rank: the kernel may
    # deliver a process-directed signal to any thread that does not block it,
    # and Python runs handlers in the main thread only, which would then sleep
    # on. The new thread inherits the mask in force when it is created.
    # (A bare thread: threading.Thread's start-up handshake costs every rank.)
    # (_signal, as above: no enum for each of the 64 signals, in and out.)
    mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())
    try:
        _thread.start_new_thread(
            _die_with_supervisor, (supervisor_pid, supervisor_is_parent, watched)
        )
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)


#: A pidfd, and the identity of its file when it was opened.
_Watched = tuple[int, tuple[int, int] | None]


def _open_supervisor(supervisor_pid: int, supervisor_is_parent: bool) -> _Watched | None:
    """A pidfd of the supervisor, or None without pidfds; kills the rank if it is gone."""
    if supervisor_is_parent and os.getppid() != supervisor_pid:
        _kill_own_group()  # it died while this rank was starting
    try:
        supervisor_fd = os.pidfd_open(supervisor_pid)
    except ProcessLookupError:
        _kill_own_group()
    except (AttributeError, OSError):  # no pidfd: not Linux, or Linux < 5.3
        return None
    if supervisor_is_parent and os.getppid() != supervisor_pid:
        _kill_own_group()  # it died before pidfd_open(): the pid may be reused
    fd = _move_high(supervisor_fd)
    return fd, _identity(fd)


def _die_with_supervisor(
    supervisor_pid: int, supervisor_is_parent: bool, watched: _Watched | None
) -> None:
    while True:
        if watched is None:
            if not _exists(supervisor_pid) or (
                supervisor_is_parent and os.getppid() != supervisor_pid
            ):
                break
            time.sleep(0.5)
            continue
        fd, identity = watched
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        events = poller.poll()  # a pidfd is readable once its process has exited
        revents = events[0][1] if events else 0
        if revents & (select.POLLIN | select.POLLHUP) and _identity(fd) == identity:
            break
        # POLLNVAL: fn closed our pidfd (os.closerange); or the number is
        # readable but holds another file of fn's now. Neither says anything
        # of the supervisor: watch it through a new pidfd.
        watched = _open_supervisor(supervisor_pid, supervisor_is_parent)
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


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # fd 2 may be closed too
        os.write(2, f"aiospawn: {line}\n".encode())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
