"""The ``aiospawn`` command: run a script, a module, a function or any program as N ranks.

The command's reference (options, launch modes, environment, signals, exit
status) is the docs' command-line page (``docs/cli.md``) and ``aiospawn run
--help``; this module is their implementation. How each rank runs its target::

    aiospawn (launcher) ── anyio.run (asyncio) ── aiospawn.start_processes(rank_*, ...)
      │  signals: SIGINT SIGTERM SIGHUP SIGQUIT → graceful shutdown, exit 128+signal
      ├── rank 0 (own process group) ─ runpy: script/module as __main__, sys.argv set
      ├── rank 1 (own process group) ─ --fn: import module, call function(rank, *args)
      └── ...                          ─ --no-python: program as a child process, in the
                                         rank's process group; its exit status becomes the rank's

What each rank runs lives in ``aiospawn._rank.programs``, which a rank imports
instead of this module. One module, parse -> plan -> supervise -> report, as
one command is one idea; it is a little over 500 lines for that reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import shutil
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

import aiospawn

from ._rank.programs import rank_function, rank_module, rank_program, rank_script, resolve_function

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._core._context import AsyncProcessContext

__all__ = ["main"]

#: Signals that make the launcher shut the ranks down.
SHUTDOWN_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

STREAM_MODES = ("prefix", "inherit", "devnull")

_PROG = "aiospawn"


# ---------------------------------------------------------------------- command line


class UsageError(Exception):
    """Bad usage: reported as one line on stderr, exit status 2, nothing started."""


def _parser() -> argparse.ArgumentParser:

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise UsageError(message)

    parser = Parser(
        prog=_PROG,
        description="Run a Python script, module, function or any program as N ranks,"
        " supervised by aiospawn.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "run",
        help="run a target as N ranks",
        description="Run TARGET as N ranks, each in a process of its own, supervised by\n"
        "aiospawn: the first rank to fail stops the others, and the launcher's exit\n"
        "status is that rank's.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nprocs",
        type=_nprocs,
        default=1,
        metavar="N",
        help="number of ranks, or 'auto' for one per CPU (default: 1)",
    )
    run.add_argument(
        "--start-method",
        choices=("spawn", "forkserver", "fork"),
        default="spawn",
        help="how rank processes are made (default: spawn)",
    )
    run.add_argument(
        "--grace-period",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="after a failure, how long the other ranks may take to exit, and the wait from"
        " SIGTERM to SIGKILL (default: no wait after a failure, 30 s to SIGKILL)",
    )
    run.add_argument(
        "--max-restarts",
        type=_count,
        default=0,
        metavar="N",
        help="restart all ranks when one fails, up to N times (default 0)",
    )
    run.add_argument(
        "--restart-window",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="count only the restarts of the last SECONDS (default: all)",
    )
    for stream in ("stdout", "stderr"):
        run.add_argument(
            f"--{stream}",
            type=_stream_mode,
            default=None,
            metavar="MODE",
            help=f"prefix, inherit, devnull or a directory (files rankN.{stream}); default:"
            " prefix with more than one rank, else inherit",
        )
    run.add_argument("--log-dir", default=None, metavar="DIR", help="both streams to files in DIR")
    run.add_argument(
        "--tee", action="store_true", help="with files: also to the terminal, behind the prefix"
    )
    run.add_argument(
        "--env",
        action="append",
        type=_env_pair,
        default=[],
        metavar="KEY=VALUE",
        help="set a variable in every rank (repeatable)",
    )
    run.add_argument(
        "--preload",
        type=_module_list,
        default=None,
        metavar="MODULES",
        help="comma-separated modules (torch,mypkg.model) imported once in a template"
        " that every rank is forked from (warm starts)",
    )
    run.add_argument(
        "-v", "--verbose", action="store_true", help="print a summary after a successful run"
    )
    kind = run.add_mutually_exclusive_group()
    kind.add_argument(
        "-m", "--module", action="store_true", help="TARGET is a module, run as python -m does"
    )
    kind.add_argument(
        "--fn",
        action="store_true",
        help="TARGET is module:function, called as function(rank, *ARGS)",
    )
    kind.add_argument(
        "--no-python", action="store_true", help="TARGET is any program, run as it is"
    )
    run.add_argument("target", nargs="?", metavar="TARGET", help="script.py, module, or program")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to TARGET")
    return parser


_EPILOG = """\
targets:
  aiospawn run script.py ARGS            the script as __main__, sys.argv = [script.py, ARGS]
  aiospawn run -m package.module ARGS    the module as __main__, as python -m does
  aiospawn run --fn pkg.mod:func ARGS    func(rank, *ARGS), ARGS as strings
  aiospawn run --no-python prog ARGS     any program, in the rank's process group

environment of each rank:
  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR=127.0.0.1,
  MASTER_PORT (free when chosen), OMP_NUM_THREADS=1 if unset and N > 1; --env wins.

signals:
  SIGINT, SIGTERM, SIGHUP, SIGQUIT: SIGTERM to the ranks, grace period, SIGKILL;
  then exit 128 + signal (130 for Ctrl-C). A second Ctrl-C SIGKILLs the ranks at once.
  If the launcher dies, even by SIGKILL, its ranks die with it.

exit status:
  0 if every rank succeeded; else the failing rank's exit code, 128 + its signal,
  or 1 if it raised; 2 for bad usage. Failures end with a summary on stderr.
  If the launcher's output pipe closes (| head), it dies of SIGPIPE, ranks too.
"""


def _nprocs(text: str) -> int:

    if text == "auto":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants a positive integer or 'auto', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"wants a positive integer or 'auto', got {text!r}")
    return value


def _seconds(text: str) -> float:

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"wants a non-negative number of seconds, got {text!r}")
    return value


def _count(text: str) -> int:

    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"wants a non-negative whole number, got {text!r}")
    return value


def _stream_mode(text: str) -> str:

    if text == "capture":
        raise argparse.ArgumentTypeError(
            "'capture' is for the Python API (ctx.output()); use prefix, inherit, devnull"
            " or a directory"
        )
    if not text:
        raise argparse.ArgumentTypeError("wants prefix, inherit, devnull or a directory")
    return text


def _env_pair(text: str) -> tuple[str, str]:

    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {text!r}")
    return key, value


class _Plan:
    """A checked ``aiospawn run`` command line: what to start and how."""

    def __init__(self, options: argparse.Namespace) -> None:
        if options.restart_window is not None and not options.max_restarts:
            raise UsageError("--restart-window needs --max-restarts N, N > 0")
        if options.restart_window == 0:
            raise UsageError("--restart-window must be more than 0 seconds")
        self.restart = (
            aiospawn.RestartPolicy(
                max_restarts=options.max_restarts,
                window=options.restart_window or math.inf,
            )
            if options.max_restarts
            else None
        )
        if options.target is None:
            raise UsageError(
                "missing TARGET: a script, -m module, --fn module:function or --no-python program"
            )
        self.nprocs: int = options.nprocs
        self.start_method: str = options.start_method
        self.preload: list[str] | None = options.preload
        self.grace_period: float | None = options.grace_period
        self.verbose: bool = options.verbose
        self.fn, self.args, self.name = _target(options)
        default = "prefix" if self.nprocs > 1 else "inherit"
        log_dir = options.log_dir
        self.stdout: str = options.stdout or log_dir or default
        self.stderr: str = options.stderr or log_dir or default
        self.tee: bool = options.tee
        if self.tee and all(mode in STREAM_MODES for mode in (self.stdout, self.stderr)):
            raise UsageError("--tee needs --log-dir DIR, or a directory for --stdout or --stderr")
        # Beside the torchrun_env variables; --env wins over both.
        self.env = dict(options.env)
        self.omp_note = (
            self.nprocs > 1
            and "OMP_NUM_THREADS" not in os.environ
            and "OMP_NUM_THREADS" not in self.env
        )
        if self.omp_note:
            self.env = {"OMP_NUM_THREADS": "1", **self.env}


def _module_list(text: str) -> list[str]:
    """``--preload`` value: comma-separated module names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected module names separated by commas, got {text!r}")
    return names


def _target(options: argparse.Namespace) -> tuple[Callable[..., None], tuple[Any, ...], str]:
    """The rank function and its arguments for the launch mode; UsageError if unusable."""

    target: str = options.target
    args: list[str] = list(options.args)
    if options.module:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as python -m: the current directory first
        _check_module(target)
        return rank_module, (target, args), f"-m {target}"
    if options.fn:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            resolve_function(target)
        except Exception as exc:
            raise UsageError(f"--fn {target}: {exc}") from None
        return rank_function, (target, args), f"--fn {target}"
    if options.no_python:
        if shutil.which(target) is None:
            raise UsageError(f"--no-python {target}: no such executable program")
        return rank_program, ([target, *args],), target
    if not os.path.exists(target):
        raise UsageError(f"script {target!r} does not exist")
    return rank_script, (target, args), target


def _check_module(name: str) -> None:

    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:  # a parent package failed to import, or a bad name
        raise UsageError(f"-m {name}: {exc}") from None
    if spec is None:
        raise UsageError(f"-m {name}: no module named {name!r}")


# ------------------------------------------------------------------------ supervision


class _Run:
    """What happened to a run: its group, its outcome, signals received."""

    def __init__(self, plan: _Plan) -> None:

        self.plan = plan
        self.started_at = time.monotonic()
        self.group: AsyncProcessContext[Any] | None = None
        self.signals: list[int] = []
        self.failure: BaseException | None = None
        self.start_error: BaseException | None = None
        self.usage_error: BaseException | None = None
        self.finished = False


async def _supervise(plan: _Plan) -> int:

    run = _Run(plan)
    signums = [getattr(signal, name) for name in SHUTDOWN_SIGNALS]
    with anyio.open_signal_receiver(*signums) as received:
        async with anyio.create_task_group() as tasks:
            ranks_scope = anyio.CancelScope()
            tasks.start_soon(_on_signals, received, run, ranks_scope)
            with ranks_scope:
                try:
                    run.group = await aiospawn.start_processes(
                        plan.fn,
                        plan.args,
                        plan.nprocs,
                        join=False,
                        start_method=plan.start_method,
                        grace_period=plan.grace_period,
                        env=plan.env,
                        torchrun_env=True,
                        restart=plan.restart,
                        stdout=plan.stdout,
                        stderr=plan.stderr,
                        tee=plan.tee,
                        preload=plan.preload,
                    )
                except (TypeError, ValueError) as exc:  # raised before anything starts
                    run.usage_error = exc
                except Exception as exc:
                    run.start_error = exc
                else:
                    try:
                        await run.group.join()
                    except aiospawn.ProcessException as exc:
                        run.failure = exc
            run.finished = True
            tasks.cancel_scope.cancel()
    return _report(run)


async def _on_signals(received: Any, run: _Run, ranks_scope: Any) -> None:

    async for signum in received:
        if run.finished:
            continue  # every rank has been reaped: the outcome stands
        if not run.signals:
            run.signals.append(signum)
            grace = run.plan.grace_period
            until = "30 s" if grace is None else f"{grace:g} s"
            _say(
                f"{signal.Signals(signum).name} received: stopping the ranks (SIGTERM, then"
                f" SIGKILL after {until}; Ctrl-C again kills them now)"
            )
            ranks_scope.cancel()
        elif signum == signal.SIGINT:
            run.signals.append(signum)
            _say("SIGINT again: killing the ranks now")
            if run.group is not None:
                await run.group.terminate(grace_period=0)  # hurries the shutdown under way


# --------------------------------------------------------------------------- reports


def _say(line: str) -> None:
    sys.stdout.flush()
    print(f"{_PROG}: {line}", file=sys.stderr, flush=True)


def _report(run: _Run) -> int:
    """Print what the run's outcome calls for; return the launcher's exit status."""

    elapsed = time.monotonic() - run.started_at
    nprocs = run.plan.nprocs
    if run.usage_error is not None:
        _say(f"error: {run.usage_error}")
        return 2
    if run.start_error is not None:
        _say(f"could not start the ranks: {run.start_error!r}")
        return 1
    failure = run.failure
    root = failure.error_index if isinstance(failure, aiospawn.ProcessException) else None
    if run.signals:
        status = 128 + run.signals[0]
    elif failure is None:
        if run.plan.verbose:
            _say(
                f"{nprocs} rank{'s' if nprocs > 1 else ''} of {run.plan.name} succeeded"
                f" in {elapsed:.2f} s"
            )
        return 0
    elif isinstance(failure, aiospawn.ProcessExitedException):
        code = failure.exit_code
        status = 128 - code if code < 0 else code
    else:
        status = 1
    if failure is not None and root is not None:
        _say(f"rank {root} failed (root cause): {_root_cause(failure)}")
    if run.group is not None:
        _say(
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


def _table(run: _Run, root: int | None) -> str:

    assert run.group is not None
    statistics = run.group.statistics()
    restarts = statistics.restarts > 0
    rows: list[tuple[str, ...]] = [("rank", "pid", "exit", "restarts", "duration")]
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
        rows.append((str(rank.rank), str(rank.pid or "-"), exit_text, str(rank.restarts), duration))
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


# ------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aiospawn`` command line; return the exit status.

    Args:
        argv: The arguments after the program name; ``None`` for ``sys.argv[1:]``.
    """
    try:
        try:
            options = _parser().parse_args(argv)
            plan = _Plan(options)
        except UsageError as exc:
            _say(f"error: {exc} (see '{_PROG} run --help')")
            return 2
        if plan.omp_note and plan.nprocs > 1:
            _say(
                f"OMP_NUM_THREADS is unset: setting it to 1 in each of the {plan.nprocs}"
                " ranks so they do not oversubscribe the CPUs; set it to choose another value"
            )
        _log_to_stderr()
        # Like other command-line tools, die of SIGPIPE when the reader of our
        # output is gone (a pipe to head); the ranks die with us.

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)

        return anyio.run(_supervise, plan, backend="asyncio")
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were in place
        return 130


def _log_to_stderr() -> None:

    logger = logging.getLogger("aiospawn")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{_PROG}: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
