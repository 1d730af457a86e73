"""The rank's process, set up before ``fn``: what the supervisor says, and what the rank does.

:class:`RankSetup` is what the supervisor tells a rank about its
surroundings; :func:`prepare` acts on it, in this order. The rank

1. drops the atexit handlers it inherited, unless it is a fresh ``spawn``
   process (a copy of the supervisor, of the fork server or of a template
   holds that process's handlers, never the rank's);
2. becomes the leader of its own process group, so that a terminal's Ctrl-C
   reaches the supervisor, which decides, and so that a shutdown signal also
   reaches the rank's own children;
3. becomes the subreaper of its descendants (see ``descendants``), so that a
   process it starts stays in its tree even after leaving its process group
   or session, or being orphaned by a double fork;
4. gets Python's default signal handling back (a ``fork`` start inherits the
   supervisor's event-loop handlers, wakeup fd and the starting thread's mask);
5. under ``fork`` only, drops what it holds of the supervisor (``forked``);
6. starts the guard that kills it once the supervisor is gone (``guard``);
7. sets its environment (a ``fork`` start has not yet), opens its channel,
   maps its heartbeat slot and answers stack requests, when the group
   watches heartbeats, and fills in the rank API's state (``api``);
8. sends its stdout and stderr where the supervisor said, at the descriptor
   level.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half; typeshed has no stub
import contextlib
import os
import stat
import sys

from . import api, descendants
from .fds import move_high
from .frames import open_channel
from .guard import guard_supervisor
from .wire import BEAT_BYTES, STACK_SIGNAL, ChildEnd

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


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
        if inherited is not None:
            # A fork rank's setup is made in the supervisor, before the fork:
            # what is imported here is in every fork rank, which then need not
            # import it itself: its hygiene, and the async main an async def
            # fn runs in (as the fork server and a template preload it).
            # (Unpickling, under the other start methods, calls no __init__.)
            from . import async_main as async_main
            from . import forked as forked

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"RankSetup({fields})"


def prepare(setup: RankSetup, report_fd: int) -> None:
    """Set the rank's process up for ``fn`` as ``setup`` says (see the module's docstring).

    Args:
        setup: The rank's surroundings.
        report_fd: The pipe the rank reports its outcome on: a ``fork`` rank
            keeps it, with its other own descriptors.
    """
    if setup.start_method != "spawn":
        # A copy of the supervisor (or of the fork server, or a template):
        # the atexit handlers it holds are that process's, never the rank's.
        # The rank's end runs those registered from here on (see
        # bootstrap's exit steps).
        import atexit

        atexit._clear()
    _become_group_leader()
    descendants.become_subreaper()
    wakeup_fd = _restore_default_signals()
    if setup.inherited is not None:
        from . import forked

        own = [
            report_fd,
            *((setup.channel.fd,) if setup.channel is not None else ()),
            *(end.fd for end in (setup.stdout, setup.stderr) if isinstance(end, ChildEnd)),
            *(end.fd for end in (setup.heartbeat, setup.stacks) if end is not None),
        ]
        forked.close_supervisor_fds(setup.inherited, set(own), wakeup_fd)
        forked.forget_supervisor_loop()
    guard_supervisor(setup.supervisor_pid, setup.supervisor_is_parent)
    if setup.env:  # a fork start has not set them yet
        os.environ.update(setup.env)
    frames = (
        None
        if setup.channel is None
        else open_channel(move_high(setup.channel.fd), shares_memory=True)
    )
    beat = None
    if setup.heartbeat is not None and setup.stacks is not None:
        beat = _watch_progress(setup.heartbeat, setup.stacks)
    # All of the rank API's state, afresh: a fork of a rank must neither beat
    # into its parent's slot nor talk on its channel.
    api.begin(restart=setup.restart, frames=frames, beat=beat)
    _redirect(sys.stdout, 1, setup.stdout)
    _redirect(sys.stderr, 2, setup.stderr)


def _watch_progress(heartbeat: ChildEnd, stacks: ChildEnd) -> memoryview:
    """Map the rank's heartbeat slot, and answer stack requests; the slot, as words."""
    import mmap  # only in ranks that beat

    shared = mmap.mmap(heartbeat.fd, BEAT_BYTES)
    os.close(heartbeat.fd)
    beat = memoryview(shared).cast("q")
    import faulthandler  # built in: no file to load

    # Written from the signal handler, in C: it works while Python code spins
    # or sleeps. The supervisor removes the guard thread's own stack.
    faulthandler.register(STACK_SIGNAL, file=move_high(stacks.fd), all_threads=True, chain=False)
    beat[1] = 1  # ready for stack requests
    return beat


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
