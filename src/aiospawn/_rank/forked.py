"""Fork hygiene: what a ``fork`` rank drops of the supervisor it is a copy of.

A ``fork`` rank starts with the supervisor's whole descriptor table and the
forking thread's thread-locals. :func:`close_supervisor_fds` closes the
descriptors aiospawn opened for supervision (its siblings' pipes, heartbeat
memory and pidfds, log directories), the event loop's epoll and the write
end of its signal wakeup pipe; every other inherited descriptor belongs to
the program the rank was forked from (a ``multiprocessing.Pipe`` in ``args``,
a log file), which ``fn`` may use, and stays open.
:func:`forget_supervisor_loop` forgets the supervisor's running trio loop.

Only ``fork`` ranks need this: the rank set-up (``process``) imports it for
them alone, and the supervisor imports it as it describes a ``fork`` rank
(:class:`~aiospawn._rank.process.RankSetup`), so that no ``fork`` rank imports
it itself. Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import sys

from .fds import identity

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping


def close_supervisor_fds(
    inherited: Mapping[int, tuple[int, int]], own: set[int], wakeup_fd: int
) -> None:
    """Close what the rank holds of the supervisor's supervision, but none of ``own``.

    Args:
        inherited: The descriptors the supervisor held for its ranks when it
            forked this one, each with the identity of its file then.
        own: This rank's own descriptors among them (its pipes and socket).
        wakeup_fd: The supervisor's signal wakeup fd (-1 if none): the
            write end of its event loop's wakeup pipe.
    """
    # The descriptors aiospawn holds for its ranks, checked against the file
    # each held when it was opened: a number closed since then may hold
    # another file of the program now, which is not ours to close.
    for fd, then in list(inherited.items()):
        if fd not in own and identity(fd) == then:
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


def forget_supervisor_loop() -> None:
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
