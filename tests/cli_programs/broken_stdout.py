"""Supervise a group while the supervisor's stdout is a broken pipe; print what happened.

Run as ``python -m tests.cli_programs.broken_stdout BACKEND`` from the
repository root (by tests/test_output.py). The group's two ranks print to
``stdout="prefix"``, whose writes fail as on a pipe to ``head``. Prints one
JSON line: the group's results or the exception it raised, the children this
process has left (unreaped ranks included), and the pipes and pidfds left
open. Whatever it leaves dies with this process.
"""

from __future__ import annotations

import gc
import json
import multiprocessing.resource_tracker
import os
import sys
from typing import Any

import anyio
import psutil

import aiospawn
from tests import ranks


class BrokenPipe:
    """A binary stream whose reader has gone: every write fails."""

    def write(self, data: bytes) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


class StdoutWithBrokenPipe:
    buffer = BrokenPipe()

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def pipes_and_pidfds() -> set[str]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:") or target == "anon_inode:[pidfd]":
            fds.add(f"{name}:{target}")
    return fds


async def supervise() -> dict[str, Any]:
    outcome: dict[str, Any] = {}
    real, sys.stdout = sys.stdout, StdoutWithBrokenPipe()  # type: ignore[assignment]
    try:
        outcome["results"] = await aiospawn.start_processes(
            ranks.out_hello, (3,), nprocs=2, stdout="prefix", grace_period=1
        )
    except BaseException as exc:
        outcome["raised"] = repr(exc)
    finally:
        sys.stdout = real
    return outcome


if __name__ == "__main__":
    multiprocessing.resource_tracker.ensure_running()  # a child of ours, not of the group
    children = {child.pid for child in psutil.Process().children()}
    fds = pipes_and_pidfds()
    outcome = anyio.run(supervise, backend=sys.argv[1])
    gc.collect()
    outcome["children left"] = sorted(
        child.pid for child in psutil.Process().children() if child.pid not in children
    )
    outcome["fds left"] = sorted(pipes_and_pidfds() - fds)
    print(json.dumps(outcome), flush=True)
