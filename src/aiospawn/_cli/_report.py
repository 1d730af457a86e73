"""What happened to a run, what the launcher prints about it, and its exit status."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import anyio

import aiospawn

from ._parse import PROG

if TYPE_CHECKING:
    from aiospawn._core._context import AsyncProcessContext

    from ._plan import Plan

__all__ = ["Run", "report", "say"]


class Run:
    """What happened to a run: its group, its outcome, signals received."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.started_at = time.monotonic()
        self.group: AsyncProcessContext[Any] | None = None
        self.signals: list[int] = []
        self.failure: BaseException | None = None
        self.start_error: BaseException | None = None
        self.usage_error: BaseException | None = None
        self.finished = False
        self.done = anyio.Event()
        #: With several nodes: the job's rank of this node's local rank 0 in
        #: the current round (the report then gives both numbers).
        self.base_rank: int | None = None

    def rank_name(self, local: int) -> str:
        """How the report names local rank ``local``: with several nodes, by both numbers."""
        if self.base_rank is None:
            return f"rank {local}"
        return f"rank {self.base_rank + local} (local rank {local})"


def say(line: str) -> None:
    """Print one line of the launcher's own on stderr, after what the ranks printed so far."""
    sys.stdout.flush()
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def report(run: Run) -> int:
    """Print what the run's outcome calls for; return the launcher's exit status."""
    elapsed = time.monotonic() - run.started_at
    nprocs = run.plan.nprocs
    if run.usage_error is not None:
        say(f"error: {run.usage_error}")
        return 2
    if run.start_error is not None:
        say(f"could not start the ranks: {run.start_error}")
        return 1
    failure = run.failure
    root = failure.error_index if isinstance(failure, aiospawn.ProcessException) else None
    if run.signals:
        status = 128 + run.signals[0]
    elif failure is None:
        if run.plan.verbose:
            say(
                f"{nprocs} rank{'s' if nprocs > 1 else ''} of {run.plan.name} succeeded"
                f" in {elapsed:.2f} s"
            )
        return 0
    elif isinstance(failure, aiospawn.ProcessExitedException):
        code = failure.exit_code
        # A status keeps 8 bits: sys.exit(256) in a rank must not read as success.
        status = 128 - code if code < 0 else code if 0 < code < 256 else 1
    else:
        status = 1
    if failure is not None and root is not None:
        say(f"{run.rank_name(root)} failed (root cause): {_root_cause(failure)}")
    if run.group is not None:
        say(
            f"summary of {run.plan.name}, {nprocs} rank{'s' if nprocs > 1 else ''},"
            f" {elapsed:.2f} s:"
        )
        print(_table(run, root), file=sys.stderr, flush=True)
    return status


def _root_cause(failure: BaseException) -> str:
    """The failure's message; for a raised exception, its last line and the stderr tail."""
    text = str(failure).strip("\n")
    notes = getattr(failure, "__notes__", None)
    if isinstance(failure, aiospawn.ProcessRaisedException):
        lines = text.splitlines()
        if notes:
            # The rank printed its traceback: the tail of its stderr shows it.
            last = lines[-1] if lines else "an exception"
            return f"raised {last}\n" + _indent("\n".join(notes))
        return "raised:\n" + _indent("\n".join(lines[1:] if lines else lines))
    first, _, rest = text.partition("\n")
    return first + ("\n" + _indent(rest) if rest else "")


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _table(run: Run, root: int | None) -> str:
    """The summary: one row per rank, with its pid, how it ended and how long it ran.

    With several nodes, the rank column gives the job's rank and the local
    one, as the launcher's other lines do.
    """
    assert run.group is not None
    statistics = run.group.statistics()
    restarts = statistics.restarts > 0
    base = run.base_rank
    rows: list[tuple[str, ...]] = [
        ("rank" if base is None else "rank (local)", "pid", "exit", "restarts", "duration")
    ]
    for rank in statistics.ranks:
        last = rank.last_exit
        if last is None:
            exit_text = "still running" if rank.pid is not None else "not started"
        elif last.signal_name is not None:
            exit_text = f"{last.signal_name} ({last.exit_code})"
        else:
            exit_text = f"exit code {last.exit_code}"
        if last is not None and last.stopped_by_us:
            exit_text += ", stopped by aiospawn"
        elif rank.rank == root and last is not None and last.signal_name == "SIGKILL":
            exit_text += ", not sent by aiospawn: out of memory? (see dmesg)"
        if rank.rank == root:
            exit_text += ", root cause"
        if last is None or rank.last_start is None:
            duration = "?"
        else:
            duration = f"{last.time - rank.last_start.time:.2f} s"
        name = str(rank.rank) if base is None else f"{base + rank.rank} ({rank.rank})"
        rows.append((name, str(rank.pid or "-"), exit_text, str(rank.restarts), duration))
    if not restarts:  # without restarts the column says nothing
        rows = [(*row[:3], row[4]) for row in rows]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if column < 2 else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append(("  " + "  ".join(cells)).rstrip())
    return "\n".join(lines)
