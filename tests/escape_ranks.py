"""Rank functions for the output-bound and escape tests (importable, as ``spawn`` needs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection


def write_lines(rank: int, count: int) -> int:
    """Write ``count`` numbered lines to stdout, one write each; return ``count``."""
    for index in range(count):
        sys.stdout.write(f"line {index}\n")
    sys.stdout.flush()
    return count


def leave_yes_running(rank: int) -> int:
    """Start ``yes`` on the rank's stdout and return at once, leaving it writing."""
    return subprocess.Popen(["yes"]).pid


def _sleeper() -> list[str]:
    # Sleeps far longer than any test; the tests expect it to be killed.
    return [sys.executable, "-c", "import time; time.sleep(600)"]


def leave_child_in_group(rank: int) -> int:
    """Start a child in the rank's own process group; return its pid (it keeps running)."""
    return subprocess.Popen(_sleeper()).pid


def leave_new_session_child(rank: int) -> int:
    """Start a child in a session of its own (``start_new_session=True``); return its pid."""
    return subprocess.Popen(_sleeper(), start_new_session=True).pid


def _ignore_sigterm() -> None:
    # Between fork and exec: the ignored disposition survives exec, so the
    # child ignores SIGTERM from its first instruction.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def leave_child_in_group_ignoring_sigterm(rank: int) -> int:
    """Start a child in the rank's process group that ignores SIGTERM; return its pid."""
    return subprocess.Popen(_sleeper(), preexec_fn=_ignore_sigterm).pid


def leave_new_session_child_ignoring_sigterm(rank: int) -> int:
    """Start a child in a session of its own that ignores SIGTERM; return its pid."""
    return subprocess.Popen(_sleeper(), start_new_session=True, preexec_fn=_ignore_sigterm).pid


def leave_daemon(rank: int) -> int:
    """Daemonise a grandchild the classic way (fork, setsid, fork); return its pid.

    The middle process exits at once, so the grandchild is an orphan in a
    session of its own: neither the rank's process group nor its children.
    """
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.close(write_end)
            os.execv(sys.executable, _sleeper())
        os.write(write_end, str(grandchild).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        pid = int(reader.read())
    os.waitpid(middle, 0)
    return pid


#: Escape routes by name; those named "group..." stay in the rank's process group.
ESCAPES = {
    "group": leave_child_in_group,
    "group-ignoring-sigterm": leave_child_in_group_ignoring_sigterm,
    "session": leave_new_session_child,
    "session-ignoring-sigterm": leave_new_session_child_ignoring_sigterm,
    "daemon": leave_daemon,
}


def escape(rank: int, how: str) -> int:
    """Leave an escapee behind (``how``: a key of :data:`ESCAPES`) and return its pid."""
    return ESCAPES[how](rank)


def escape_then_end(rank: int, how: str, end: str, events: Connection) -> None:
    """Leave an escapee, send its pid, then end without the rank's own exit path.

    ``end``: ``"os._exit"`` (no Python exit at all) or ``"execv"`` (the
    process becomes ``sh -c 'exit 0'``, and nothing of the bootstrap is left).
    """
    events.send(ESCAPES[how](rank))
    if end == "execv":
        os.execv("/bin/sh", ["sh", "-c", "exit 0"])
    os._exit(0)


def escape_then_wait(rank: int, how: str, events: Connection) -> None:
    """Leave an escapee, send ``(rank pid, escapee pid)``, then wait to be stopped."""
    events.send((os.getpid(), ESCAPES[how](rank)))
    while True:
        time.sleep(60)
