"""The parent-death guard: a rank dies, with everything it started, once its supervisor is gone.

:func:`guard_supervisor` starts a bare thread that waits on a pidfd of the
supervising *process*, however it dies (SIGKILL too), and then SIGKILLs the
rank's process group and every descendant that left it (see
``descendants``). ``PR_SET_PDEATHSIG`` cannot do this: it fires when the
*thread* that forked the rank exits (prctl(2)), and supervisors start ranks
from worker threads that retire. Under ``forkserver`` and from a warm
template the rank's parent is not the supervisor, so the guard watches the
supervisor itself, not the parent.

``fn`` may close the guard's pidfd (``os.closerange``) or reuse its number:
the guard tells that apart from the supervisor's exit by the identity of its
file (see ``fds``), and opens another. Without pidfds (not Linux, or Linux
before 5.3) it polls twice a second.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half; typeshed has no stub
import _thread
import contextlib
import os
import select
import signal
import time

from . import descendants
from .fds import identity, move_high


def guard_supervisor(supervisor_pid: int, supervisor_is_parent: bool) -> None:
    """Start the guard thread; kill the rank at once if the supervisor is gone already.

    Args:
        supervisor_pid: The supervising process.
        supervisor_is_parent: It is also this process's parent (``spawn`` and
            ``fork``), so a changed parent pid tells of its death too.
    """
    # Watch the supervisor itself, not our parent: under forkserver the parent
    # is the fork server, which cannot exit while its children hold its
    # "alive" pipe, so waiting for it would keep both alive forever.
    watched = _open_supervisor(supervisor_pid, supervisor_is_parent)
    # The guard must never take a signal meant for the rank: the kernel may
    # deliver a process-directed signal to any thread that does not block it,
    # and Python runs handlers in the main thread only, which would then sleep
    # on. The new thread inherits the mask in force when it is created.
    # (A bare thread: threading.Thread's start-up handshake costs every rank.)
    # (_signal, the C module under signal: no enum for each of the 64
    # signals, in and out.)
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
    fd = move_high(supervisor_fd)
    return fd, identity(fd)


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
        fd, opened = watched
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        events = poller.poll()  # a pidfd is readable once its process has exited
        revents = events[0][1] if events else 0
        if revents & (select.POLLIN | select.POLLHUP) and identity(fd) == opened:
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
