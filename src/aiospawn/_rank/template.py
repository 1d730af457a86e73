"""A warm-start template: a spawned process that imports modules once, then forks ranks.

The supervisor starts the template with ``multiprocessing``'s ``spawn`` (a fresh
interpreter with the supervisor's ``sys.path``, ``sys.argv``, working directory
and main script, imported as ``__mp_main__`` as a ``spawn`` or ``forkserver``
child does). :func:`serve` then imports the preload modules, checks that the
process is still safe to fork, and answers the supervisor::

    supervisor                                  template (one thread)
    ----------                                  ---------------------
    control socket (SOCK_SEQPACKET) ◄────────── b"R" ready (+ notes), or b"E" + why not
    b"F" + fds [status end, rank's fds...] ───► fork ──► rank: reads its payload
    status socket (SOCK_STREAM) ◄──────────────  b"P" + pid        from the status end,
                                       ...       runs run_rank()
    status socket ◄──────────────────────────── b"X" + exit code, once reaped

The template is the ranks' parent, so only it can reap them and read their
exit status (waitpid(2)); it sends each status on the rank's own status
socket, where the rank's watcher in the supervisor waits for it. The rank's
payload (``fn``, its arguments, its setup) goes straight from the supervisor to
the rank on that socket: the template never holds a large payload, and never
waits for a rank to read one.

The template waits for work, its children's exits and the supervisor's death
on one ``poll()``, on its single thread: forking a process that runs other
threads is unsafe (a lock held by another thread stays held in the child
forever). It exits when the supervisor closes the control socket or dies; its
ranks die with it (``PR_SET_PDEATHSIG``, sound here because the template has
one thread), and each rank also watches the supervisor itself (``bootstrap``).

The template is the subreaper of its descendants, as a rank is (see
``descendants``): processes a preload module started at import (a
``subprocess.Popen``, an ``os.fork``), and whatever a rank left behind when it
died, stay in its tree. It reaps those that exit while it runs (``SIGCHLD``
wakes its ``poll()``), and kills all that are left when it ends, so that none
outlives it (a SIGKILLed template cannot: its ranks still die with it).

Standard library only, like the rest of ``aiospawn._rank``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

# The async main and the awaited channel are imported once, here, for the
# ranks the template forks, as the bootstrap is.
from . import async_channel as async_channel
from . import async_main as async_main
from . import descendants
from .bootstrap import run_rank
from .process import RankSetup
from .wire import ChildEnd

#: A status message: ``b"P"`` and the rank's pid, or ``b"X"`` and its exit code
#: (``-signal`` when a signal ended it), as ``os.waitstatus_to_exitcode`` gives.
STATUS = struct.Struct("!cq")

#: Precedes the rank's payload on its status socket: the payload's size.
PAYLOAD_SIZE = struct.Struct("!Q")

#: The most descriptors one fork request carries (the status end included).
MAX_FDS = 64

#: ``prctl(2)`` option: the signal this process gets when its parent thread exits.
_PR_SET_PDEATHSIG = 1

#: Seconds the template waits, as it ends, for the descendants it killed to be
#: gone (well within the supervisor's patience with a stopping template).
END_PATIENCE = 2.0

#: The fds a rank was sent with its fork request, in the order of its payload's
#: :class:`ReceivedFd` indices (set in the rank just before its payload is read).
_received: list[int] = []


class ReceivedFd:
    """An fd of the rank's payload, sent with its fork request rather than pickled.

    ``multiprocessing.reduction.DupFd`` asks the spawning "popen" to carry
    fds (pipes, connections, ``ChildEnd`` objects) and pickles one of these
    in their place; :meth:`detach` hands the rank its copy.
    """

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        """The rank's own copy of the fd."""
        return _received[self.index]


class FdCollector:
    """The spawning "popen" of a warm rank's payload: collects the fds to send with it.

    While it is installed (``multiprocessing.context.set_spawning_popen``),
    objects that carry an fd (``ChildEnd``, ``multiprocessing`` connections and
    queues) pickle as for a ``forkserver`` child; ``fds`` then lists the fds to
    send, in :class:`ReceivedFd` order.
    """

    DupFd = ReceivedFd

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        """Add ``fd`` to those sent with the rank; return its index."""
        self.fds.append(fd)
        return len(self.fds) - 1


class _Rank(NamedTuple):
    fn: Callable[..., Any]
    rank: int
    args: tuple[Any, ...]
    channel: ChildEnd
    setup: RankSetup


def serve(control: ChildEnd, preload: tuple[str, ...], supervisor_pid: int) -> None:
    """The template's life: preload, check, then fork ranks until the supervisor goes.

    ``multiprocessing`` runs this as the target of the spawned template. A
    forked rank never returns from it: it ends in ``run_rank`` as a forkserver
    rank does, with multiprocessing's exit steps and then ``os._exit``. An
    interpreter shutdown would finalise every preloaded module in every rank
    (about a second each with torch, measured on 2 cores), and the rank has
    reported its outcome by then.

    Args:
        control: The template's end of the control socket.
        preload: The modules to import, in order.
        supervisor_pid: The supervising process.
    """
    # A terminal's Ctrl-C reaches our process group too; the supervisor
    # decides what it means. The ranks get SIGINT's default back.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before the preload: what it starts stays ours to reap and to kill.
    descendants.become_subreaper()
    template = os.getpid()
    try:
        rank = _serve(socket.socket(fileno=control.fd), preload, supervisor_pid)
    finally:
        if os.getpid() == template:  # not in a rank, which returns from _Loop.run too
            descendants.kill_descendants(template, END_PATIENCE)
            _reap_all()
    if rank is not None:
        # The rank's frames start here, outside the loop's own handlers.
        try:
            run_rank(rank.fn, rank.rank, rank.args, rank.channel, rank.setup)
        finally:
            os._exit(1)  # run_rank ends the process itself; never the template's code


def _serve(sock: socket.socket, preload: tuple[str, ...], supervisor_pid: int) -> _Rank | None:
    """Preload, answer, and serve fork requests; the rank to run in a forked child, else None."""
    refusal, notes = _preload(preload)
    # The supervisor may have stopped waiting (a stale template it stopped
    # while this one imported): then the loop finds the socket closed.
    if refusal is not None:
        with contextlib.suppress(OSError):
            sock.send(b"E" + refusal.encode("utf-8", "replace"))
        return None
    # Objects the preload made will not be freed: keep the collector off their
    # memory, so that it stays shared with the ranks instead of being copied
    # page by page when a rank's collection touches it (gc.freeze docs).
    gc.collect()
    gc.freeze()
    with contextlib.suppress(OSError):
        sock.send(b"R" + "\n".join(notes).encode("utf-8", "replace"))
    return _Loop(sock, supervisor_pid).run()


def _preload(modules: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """Import ``modules`` one by one.

    Returns:
        Why forking is now unsafe (or None), and notes on native threads
        that the imports left behind.
    """
    notes: list[str] = []
    threads = [1]  # native threads so far: the main thread

    def note_native(what: str) -> None:
        # Threads of C libraries, which Python does not know of. The common
        # one is OpenBLAS's pool, started when numpy is imported (torch imports
        # numpy); OpenBLAS stops and restarts it around fork (pthread_atfork),
        # and a preloaded multiprocessing fork server forks with it too.
        # Refusing them would refuse torch wherever numpy is installed.
        native = _native_threads()
        if native > threads[0]:
            notes.append(
                f"{what} left {native - threads[0]} native thread(s) running (not Python"
                " threads; OpenBLAS's pool, started by numpy, is one): forked ranks do"
                " not have them"
            )
            threads[0] = native

    culprit = _unsafe_state()
    if culprit is not None:
        return f"the main script ({_main_file()}) {culprit} when the template imported it", notes
    note_native("the main script")
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:
            why = f"preload module {name!r} could not be imported:\n{traceback.format_exc()}"
            return why, notes
        culprit = _unsafe_state()
        if culprit is not None:
            return f"importing preload module {name!r} {culprit}", notes
        note_native(f"preload module {name!r}")
    return None, notes


def _unsafe_state() -> str | None:
    python_threads = threading.active_count()
    if python_threads > 1:
        main = threading.main_thread()
        names = [thread.name for thread in threading.enumerate() if thread is not main]
        return (
            f"started Python threads {names}; a process running threads cannot be"
            " forked safely: start the threads in the rank instead, or leave the"
            " module out of preload"
        )
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if is_initialized is not None and is_initialized():
        return (
            "initialised CUDA; a CUDA context does not survive fork: touch the GPU"
            " only in the rank, or leave the module out of preload"
        )
    return None


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _main_file() -> str:
    return str(getattr(sys.modules.get("__main__"), "__file__", "__main__"))


class _Loop:
    """The template's one-thread loop: fork requests, exits of ranks, the supervisor."""

    def __init__(self, sock: socket.socket, supervisor_pid: int) -> None:
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._supervisor: int | None
        try:
            self._supervisor = os.pidfd_open(supervisor_pid)
        except OSError:
            self._supervisor = None  # already gone: the control socket says so too
        else:
            self._poller.register(self._supervisor, select.POLLIN)
        #: pidfd -> (pid, the rank's status socket)
        self._children: dict[int, tuple[int, socket.socket]] = {}
        # Other children (the preload's, orphans re-parented to this
        # subreaper) are reaped when SIGCHLD says one exited: the handler does
        # nothing, the wakeup fd wakes poll().
        self._wakeup, self._wakeup_w = os.pipe()
        for fd in (self._wakeup, self._wakeup_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, _ignore_signal)
        signal.set_wakeup_fd(self._wakeup_w)
        self._poller.register(self._wakeup, select.POLLIN)
        self._reap_strays()  # those that exited before we listened

    def run(self) -> _Rank | None:
        """Serve until the supervisor goes (None), or return the rank in a forked child."""
        while True:
            for fd, _events in self._poller.poll():
                if fd == self._sock.fileno():
                    try:
                        message, fds, flags, _ = socket.recv_fds(self._sock, 16, MAX_FDS)
                    except OSError:
                        message, fds, flags = b"", [], 0
                    if not message:
                        return None  # the supervisor closed its end, or died
                    rank = self._fork(fds, truncated=bool(flags & socket.MSG_CTRUNC))
                    if rank is not None:
                        return rank
                elif fd == self._supervisor:
                    return None
                elif fd == self._wakeup:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wakeup, 512):
                            pass
                    self._reap_strays()
                else:
                    self._reap(fd)

    def _fork(self, fds: list[int], *, truncated: bool) -> _Rank | None:
        status = socket.socket(fileno=fds[0]) if fds else None
        if status is None or truncated:
            for fd in fds[1:]:
                os.close(fd)
            if status is not None:
                status.close()  # the supervisor's start sees end-of-file
            return None
        template = os.getpid()
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns of native threads at fork (see _preload for
                # which are left, and why); under -W error the warning would
                # raise here with the rank already forked.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:
            for fd in fds[1:]:
                os.close(fd)
            status.close()
            return None
        if pid == 0:
            try:
                return self._become_rank(status, fds[1:], template)
            except BaseException:
                # Its payload did not arrive or did not unpickle: the rank
                # must not go on into the template's own code.
                traceback.print_exc()
                os._exit(1)
        for fd in fds[1:]:
            os.close(fd)  # the rank's alone: its pipes must end when it does
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = -1
        # If the supervisor gave up on this start, the exit is reaped all the same.
        with contextlib.suppress(OSError):
            status.sendall(STATUS.pack(b"P", pid))
        if pidfd < 0:
            # No pidfd (Linux < 5.3): wait for this rank now; the supervisor
            # still gets its status, later ranks start after it ends.
            self._send_status(pid, status, os.waitpid(pid, 0)[1])
            return None
        self._children[pidfd] = (pid, status)
        self._poller.register(pidfd, select.POLLIN)
        return None

    def _reap(self, pidfd: int) -> None:
        self._poller.unregister(pidfd)
        pid, status = self._children.pop(pidfd)
        os.close(pidfd)
        _, wait_status = os.waitpid(pid, 0)  # readable pidfd: it has exited
        self._send_status(pid, status, wait_status)

    def _reap_strays(self) -> None:
        ranks = {pid for pid, _ in self._children.values()}  # reaped by _reap, status sent
        for pid in descendants.children(os.getpid()):
            if pid not in ranks:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def _send_status(self, pid: int, status: socket.socket, wait_status: int) -> None:
        with contextlib.suppress(OSError):  # the supervisor has stopped listening
            status.sendall(STATUS.pack(b"X", os.waitstatus_to_exitcode(wait_status)))
        status.close()

    def _become_rank(self, status: socket.socket, fds: list[int], template: int) -> _Rank:
        # Nothing of the template's own belongs to a rank: not the control
        # socket, not the pidfds and status sockets of its siblings.
        self._sock.close()
        if self._supervisor is not None:
            os.close(self._supervisor)
        for pidfd, (_, sibling) in self._children.items():
            os.close(pidfd)
            sibling.close()
        self._children.clear()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self._wakeup)
        os.close(self._wakeup_w)
        _die_with_parent(template)
        for fd in fds:
            os.set_inheritable(fd, False)  # as a spawn child has them: no leak into exec
        _received[:] = fds
        size = PAYLOAD_SIZE.unpack(_read_exactly(status, PAYLOAD_SIZE.size))[0]
        payload = _read_exactly(status, size)
        status.close()
        setup_pickle, call_pickle = pickle.loads(payload)
        setup: RankSetup = pickle.loads(setup_pickle)
        # Before fn's module is imported, as under spawn and forkserver.
        if setup.env:
            os.environ.update(setup.env)
        fn, index, args, channel, name = pickle.loads(call_pickle)
        _after_fork(name)
        return _Rank(fn, index, args, channel, setup)


def _reap_all() -> None:
    # Our children that have exited: not left as zombies for init to find.
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _ignore_signal(signum: int, frame: object) -> None:
    pass


def _die_with_parent(parent: int) -> None:
    # Only the template can reap a rank and learn its exit status; a rank that
    # outlived it could be neither watched nor reported. prctl(2) ties this
    # process to the thread that forked it: the template's one thread.
    # ``parent`` is the template's pid from before the fork: had it died
    # since (while at-fork hooks ran, say), os.getppid() would name whoever
    # took the rank over, and the check below would pass.
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (ImportError, OSError, AttributeError):  # not Linux: the supervisor guard remains
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)  # the template died before prctl()


def _after_fork(name: str) -> None:
    # What multiprocessing does in each forkserver child: run the hooks that
    # objects made by the preload registered for forks, drop the template's
    # finalizers (they are not the rank's to run), and name the process.
    import multiprocessing
    import multiprocessing.util as util

    finalizers = getattr(util, "_finalizer_registry", None)
    if finalizers is not None:
        finalizers.clear()
    run_after_forkers = getattr(util, "_run_after_forkers", None)
    if run_after_forkers is not None:
        run_after_forkers()
    multiprocessing.current_process().name = name


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise EOFError("the supervisor closed the rank's status socket before its payload")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
