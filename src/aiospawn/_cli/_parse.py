"""The command line of ``aiospawn``: its flags, their checks, and its usage errors.

:func:`parser` reads the command line into an :class:`argparse.Namespace`;
the type functions here check one value each, and :class:`UsageError` carries
any complaint out as one line on stderr with exit status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import NoReturn

__all__ = ["EPILOG", "PROG", "SHUTDOWN_SIGNALS", "STREAM_MODES", "UsageError", "parser"]

#: Signals that make the launcher shut the ranks down.
SHUTDOWN_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

STREAM_MODES = ("prefix", "inherit", "devnull")

PROG = "aiospawn"


class UsageError(Exception):
    """Bad usage: reported as one line on stderr, exit status 2, nothing started."""


def parser() -> argparse.ArgumentParser:

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise UsageError(message)

    parser = Parser(
        prog=PROG,
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
        epilog=EPILOG,
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


EPILOG = """\
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
