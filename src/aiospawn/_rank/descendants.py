"""A rank's descendants, wherever they went: found through ``/proc``, killed by pidfd.

A process a rank starts can leave the rank's process group (``setsid()``,
``Popen(start_new_session=True)``), so signalling the group misses it; and
once its parent exits it is re-parented, normally to init, where nothing ties
it to the rank any more. A rank therefore marks itself a *child subreaper*
(prctl(2), ``PR_SET_CHILD_SUBREAPER``): its orphaned descendants are
re-parented to the rank itself, and every process it started stays in its
tree of descendants, which ``/proc`` shows, for as long as the rank lives.

:func:`kill_descendants` SIGKILLs that tree. The rank runs it when ``fn``
ends, before it reports, and its guard thread when the supervisor dies; the
supervisor uses :func:`pin_descendants` to reach them with its shutdown signals.

Each process is signalled through a pidfd opened *before* its parent is
checked again, so a pid that was reused meanwhile is never signalled.

This module runs in every rank: standard library only (``ctypes`` for prctl).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable

#: prctl(2) option: orphaned descendants are re-parented to this process.
PR_SET_CHILD_SUBREAPER = 36


def _find_prctl() -> Callable[..., int] | None:
    # prctl has no os-level binding: libc's, through ctypes. Looked up at
    # import, not in become_subreaper(): a fork rank then finds it in the
    # supervisor, a forkserver rank in the fork server that preloaded the
    # bootstrap. Imported and looked up by each rank, it took 3-10 ms of
    # every rank's start.
    try:
        import ctypes

        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):  # no _ctypes, or no libc prctl: not Linux
        return None
    return prctl


_prctl = _find_prctl()


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants; False where that fails."""
    return _prctl is not None and _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def descendants(root: int) -> list[int]:
    """The pids of ``root``'s live descendants, parents before their children."""
    found: list[int] = []
    seen = {root}
    parents = [root]
    table: dict[int, list[int]] | None = None
    while parents:
        children: list[int] = []
        for parent in parents:
            listed = _children(parent)
            if listed is None:  # no /proc/PID/task/TID/children: scan all of /proc once
                if table is None:
                    table = _children_table()
                listed = table.get(parent, [])
            children.extend(pid for pid in listed if pid not in seen)
        seen.update(children)
        found.extend(pid for pid in children if _state(pid)[0] not in ("Z", "X", ""))
        parents = children
    return found


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children, zombies included."""
    listed = _children(pid)
    return listed if listed is not None else _children_table().get(pid, [])


def pin_descendants(root: int, *, group: int) -> tuple[list[int], list[int]]:
    """Pidfds of ``root``'s live descendants: ``(outside, inside)`` the process group ``group``.

    Taken before ``root`` is signalled: once it dies, its children are
    re-parented and no longer show as its descendants. Signal them with
    :func:`signal_pinned`; close them with :func:`close_pinned`.
    """
    tree = descendants(root)
    members = {root, *tree}
    outside: list[int] = []
    inside: list[int] = []
    for pid in tree:
        try:
            in_group = os.getpgid(pid) == group
        except OSError:
            continue  # gone
        fd = _pin(pid, members)
        if fd is not None:
            (inside if in_group else outside).append(fd)
    return outside, inside


def signal_pinned(pidfds: list[int], signum: int) -> None:
    """Send ``signum`` to each process pinned by :func:`pin_descendants`."""
    for fd in pidfds:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signum)


def close_pinned(pidfds: list[int]) -> None:
    """Close the pidfds of :func:`pin_descendants`."""
    for fd in pidfds:
        os.close(fd)


def kill_descendants(root: int, patience: float) -> bool:
    """SIGKILL every descendant of ``root`` and wait, up to ``patience`` s, until none lives.

    Repeated until the tree is empty, since a process may fork (or be
    re-parented into the tree) while its relatives are being killed.

    Returns:
        True once no descendant lives; False if one still did after ``patience``.
    """
    deadline = time.monotonic() + patience
    while True:
        tree = descendants(root)
        if not tree:
            return True
        members = {root, *tree}
        pidfds = [fd for fd in (_kill(pid, members) for pid in tree) if fd is not None]
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return not descendants(root)
            _wait_all(pidfds, remaining)
        finally:
            for fd in pidfds:
                os.close(fd)


def _kill(pid: int, members: set[int]) -> int | None:
    """SIGKILL ``pid`` if it is still a child of one of ``members``; its pidfd, if any."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): a plain kill
        if _state(pid)[1] in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return None
    # The pidfd pins this very process: if its parent is still one of ours,
    # it is the process we found, not a newcomer that reuses the pid.
    if _state(pid)[1] in members:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    return pidfd


def _pin(pid: int, members: set[int]) -> int | None:
    """A pidfd of ``pid`` if it is still a child of one of ``members`` (see :func:`_kill`)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone, or no pidfd: not pinned, not signalled
        return None
    if _state(pid)[1] in members:
        return pidfd
    os.close(pidfd)
    return None


def _wait_all(pidfds: list[int], patience: float) -> None:
    """Wait until every pidfd is readable (its process exited), or ``patience`` passed."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    waiting = len(pidfds)
    deadline = time.monotonic() + patience
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        for fd, _ in poller.poll(max(1, int(remaining * 1000))):
            poller.unregister(fd)
            waiting -= 1
    if not pidfds:
        # Without pidfds there is nothing to wait on: give the kills a moment.
        time.sleep(min(patience, 0.01))


def _children(pid: int) -> list[int] | None:
    """``pid``'s children from /proc (all its threads'); None if the kernel has no such file."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # it exited
    children: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children", "rb") as listing:
                children.extend(int(child) for child in listing.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{thread}"):
                continue  # the thread ended
            return None  # CONFIG_PROC_CHILDREN is off
        except OSError:
            continue
    return children


def _children_table() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            parent = _state(int(name))[1]
            if parent >= 0:
                table.setdefault(parent, []).append(int(name))
    return table


def _state(pid: int) -> tuple[str, int]:
    """``(state letter, parent pid)`` of ``pid``; ``("", -1)`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return "", -1
    # The command name, in parentheses, may itself hold spaces and parentheses.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])
