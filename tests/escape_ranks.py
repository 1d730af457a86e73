"""Rank functions for the output-bound and escape tests (importable, as ``spawn`` needs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


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


def report_escapees_then_wait(rank: int, report_path: str, how: str) -> None:
    """Start an escapee (``how``: group, session, daemon), write its pid, then wait for ever.

    The test SIGKILLs the supervisor meanwhile.
    """
    starters = {
        "group": leave_child_in_group,
        "session": leave_new_session_child,
        "daemon": leave_daemon,
    }
    pid = starters[how](rank)
    with open(report_path + ".tmp", "w") as report:
        report.write(f"{os.getpid()} {pid}\n")
    os.rename(report_path + ".tmp", report_path)
    while True:
        time.sleep(60)
