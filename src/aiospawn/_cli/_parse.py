"""The command line of ``aiospawn``: its flags, and its usage errors.

Most of this module is one table, the flag declarations and their help, which
are the command's reference (``aiospawn run --help``); splitting it would
scatter that table.

:func:`parse` reads the command line into an :class:`argparse.Namespace`;
each option's value is checked by its type function in :mod:`._values`, and
:class:`UsageError` carries any complaint out as one line on stderr with exit
status 2, before anything starts. torchrun's command line is accepted beside
ours: its spellings, its stream choices and its rendezvous flags come from
:mod:`._torchrun`, which says how.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import aiospawn

from ._torchrun import RENDEZVOUS_FLAGS, attach_tee_values, spellings, std, tee
from ._values import (
    count,
    device_list,
    env_pair,
    module_list,
    nprocs,
    positive_seconds,
    rank_list,
    seconds,
    signal_list,
    stream_mode,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "EPILOG",
    "PROG",
    "SHUTDOWN_SIGNALS",
    "STATUS_RANKS",
    "UsageError",
    "parse",
    "parser",
]

#: Signals that make the launcher shut the ranks down, in torchrun's order: the
#: ranks see them joined in TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun's do.
SHUTDOWN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

PROG = "aiospawn"

#: More ranks than this get the status line by default on a terminal.
STATUS_RANKS = 4


class UsageError(Exception):
    """Bad usage: reported as one line on stderr, exit status 2, nothing started."""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; :class:`UsageError` if it is bad.

    ``aiospawn`` alone prints the usage and exits 2 (``SystemExit``), and
    ``--version`` and ``--help`` print and exit 0, as argparse does.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    top, takes_value = parser()
    if not args:
        top.print_usage(sys.stderr)
        raise SystemExit(2)
    if args[0] == "run":
        args = [args[0], *attach_tee_values(args[1:], takes_value)]
    return top.parse_args(args)


class _Container(Protocol):
    """A parser, or one of its argument groups."""

    def add_argument(self, *names: str, **options: Any) -> argparse.Action: ...


class _Kept:
    """Declares options on a parser or one of its groups, and keeps their actions.

    argparse documents that ``add_argument`` returns the option's
    :class:`argparse.Action`, but not where a parser keeps them (``_actions``,
    private): which options take a value is read from what it returned.
    """

    def __init__(self, where: _Container, kept: list[argparse.Action]) -> None:
        self._where = where
        self._kept = kept

    def add_argument(self, *names: str, **options: Any) -> None:
        self._kept.append(self._where.add_argument(*names, **options))


def parser() -> tuple[argparse.ArgumentParser, frozenset[str]]:
    """The ``aiospawn`` parser, and the option strings of ``run`` that take a value."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise UsageError(message)

    top = Parser(
        prog=PROG,
        description="Run a Python script, module, function or any program as N ranks,"
        " supervised by aiospawn.",
    )
    version = f"{PROG} {aiospawn.__version__}"
    top.add_argument("--version", action="version", version=version)
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run_parser = commands.add_parser(
        "run",
        help="run a target as N ranks",
        description="Run TARGET as N ranks, each in a process of its own, supervised by\n"
        "aiospawn: the first rank to fail stops the others, and the launcher's exit\n"
        "status is that rank's. torchrun's flags are accepted in its spellings\n"
        "(--nproc_per_node, ...); with --nnodes above 1 this launcher is one node of\n"
        "a job and joins torch's rendezvous, as torchrun does.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kept: list[argparse.Action] = []
    run = _Kept(run_parser, kept)
    # After "run" too: that is where a user who just read "aiospawn run --help" types it.
    run.add_argument("--version", action="version", version=version)
    run.add_argument(
        *spellings("-n", "--nprocs", "--nproc-per-node"),
        dest="nprocs",
        type=nprocs,
        default=None,
        metavar="N",
        help="number of ranks; 'cpu' for one per CPU, 'gpu' for one per visible GPU, 'auto'"
        " for one per visible GPU if there is any, else one per CPU (default: 1)",
    )
    run.add_argument(
        *spellings("--start-method"),
        choices=("spawn", "forkserver", "fork"),
        default="spawn",
        help="how rank processes are made (default: spawn)",
    )
    run.add_argument(
        *spellings("--run-path"),
        action="store_true",
        help="torchrun's: run the script in the rank's interpreter (what aiospawn always does)",
    )

    shutdown = _Kept(run_parser.add_argument_group("shutdown and restarts"), kept)
    shutdown.add_argument(
        "--grace-period",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="after a failure, how long the other ranks may take to exit, and the wait from"
        " SIGTERM to SIGKILL (default: no wait after a failure, 30 s to SIGKILL)",
    )
    shutdown.add_argument(
        *spellings("--shutdown-timeout"),
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="torchrun's: the wait from SIGTERM to SIGKILL; as --grace-period (default:"
        " $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    )
    shutdown.add_argument(
        *spellings("--signals-to-handle"),
        type=signal_list,
        default=None,
        metavar="SIGNALS",
        help="signals that stop the run, comma-separated (default:"
        f" {','.join(SHUTDOWN_SIGNALS)}); any other is sent on to the ranks first, which"
        " then have the shutdown timeout to exit (SIGUSR1 for SLURM preemption)",
    )
    shutdown.add_argument(
        *spellings("--max-restarts"),
        type=count,
        default=None,
        metavar="N",
        help="restart ranks when one fails, up to N times (default 0); across nodes, a new"
        " rendezvous round on every node",
    )
    shutdown.add_argument(
        "--restart-window",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="count only the restarts of the last SECONDS (default: all)",
    )
    shutdown.add_argument(
        "--restart-strategy",
        choices=("one_for_all", "one_for_one"),
        default=None,
        help="restart every rank (one_for_all, the default, as torchrun does) or the failed"
        " rank alone (one_for_one)",
    )
    shutdown.add_argument(
        "--restart-backoff",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="wait before the first restart, doubled for each quick restart after it, at"
        " most 30 s or SECONDS (default 0.5)",
    )
    shutdown.add_argument(
        "--heartbeat-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a rank that called aiospawn.heartbeat() and then goes SECONDS without it is"
        " hung: its stacks are printed and it fails (or restarts)",
    )
    shutdown.add_argument(
        "--startup-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a rank that has not called aiospawn.heartbeat() SECONDS after it started is hung",
    )

    output = _Kept(run_parser.add_argument_group("output"), kept)
    for stream in ("stdout", "stderr"):
        output.add_argument(
            f"--{stream}",
            type=stream_mode,
            default=None,
            metavar="MODE",
            help=f"prefix, inherit, devnull or a directory (files rankN.{stream}); default:"
            " prefix with more than one rank, else inherit",
        )
    output.add_argument(
        *spellings("--log-dir"),
        default=None,
        metavar="DIR",
        help="both streams to files in DIR; with -r or -t, only where their files go",
    )
    output.add_argument(
        *spellings("-r", "--redirects"),
        type=std,
        default=None,
        metavar="STD",
        help="torchrun's: streams to files in --log-dir: 0 none, 1 stdout, 2 stderr, 3 both;"
        " or per rank, 0:3,1:1",
    )
    output.add_argument(
        "-t",
        "--tee",
        type=tee,
        default=None,
        metavar="STD",
        help="streams to files and the terminal, as for -r; alone: tee every stream that goes"
        " to files",
    )
    output.add_argument(
        *spellings("--local-ranks-filter"),
        type=rank_list,
        default=None,
        metavar="RANKS",
        help="show only these ranks' output on the terminal, e.g. 0 or 0,3 (files are"
        " still written)",
    )
    output.add_argument(
        "--status",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a status line below the output (default: on a terminal with more than"
        f" {STATUS_RANKS} ranks; never when stderr is not a terminal)",
    )
    output.add_argument(
        "-v", "--verbose", action="store_true", help="print a summary after a successful run"
    )

    ranks = _Kept(run_parser.add_argument_group("each rank's environment"), kept)
    ranks.add_argument(
        "--env",
        action="append",
        type=env_pair,
        default=[],
        metavar="KEY[=VALUE]",
        help="set a variable in every rank (repeatable); KEY alone: its value here, which keeps"
        " a secret out of the command line",
    )
    ranks.add_argument(
        "--preload",
        type=module_list,
        default=None,
        metavar="MODULES",
        help="comma-separated modules (torch,mypkg.model) imported once in a template"
        " that every rank is forked from (warm starts)",
    )
    ranks.add_argument(
        "--devices-per-rank",
        type=count,
        default=None,
        metavar="N",
        help="give each rank N devices of its own in CUDA_VISIBLE_DEVICES (0: none); on Ray,"
        " N GPUs per rank",
    )
    ranks.add_argument(
        "--devices",
        type=device_list,
        default=None,
        metavar="IDS",
        help="the devices to share out, e.g. 0,1,2,3 (default: the visible ones)",
    )
    ranks.add_argument(
        *spellings("--virtual-local-rank"),
        action="store_true",
        help="torchrun's: LOCAL_RANK=0 in every rank, each with one device of its own",
    )
    ranks.add_argument(
        "--role", default="default", metavar="NAME", help="ROLE_NAME, and the line prefix"
    )
    ranks.add_argument(
        *spellings("--run-id", "--rdzv-id"),
        default=None,
        metavar="ID",
        help="TORCHELASTIC_RUN_ID (default: a new random id)",
    )

    ray = _Kept(run_parser.add_argument_group("on a Ray cluster"), kept)
    ray.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the ranks on the Ray cluster at ADDRESS ('auto', HOST:6379), one actor each",
    )
    ray.add_argument(
        "--placement",
        type=str.upper,
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        default=None,
        help="how the ranks spread over Ray's nodes (default PACK)",
    )

    single = _Kept(
        run_parser.add_argument_group(
            "torchrun's rendezvous (several nodes: docs/cli-multinode.md; also read from PET_*)"
        ),
        kept,
    )
    single.add_argument(
        "--standalone", action="store_true", help="one node, as torchrun's (what aiospawn does)"
    )
    for name, metavar, help_text in RENDEZVOUS_FLAGS:
        single.add_argument(
            *spellings(name),
            default=None,
            metavar=metavar,
            help=help_text or argparse.SUPPRESS,
        )

    kind = _Kept(run_parser.add_mutually_exclusive_group(), kept)
    kind.add_argument(
        "-m", "--module", action="store_true", help="TARGET is a module, run as python -m does"
    )
    kind.add_argument(
        "--fn",
        action="store_true",
        help="TARGET is module:function, called as function(rank, *ARGS)",
    )
    kind.add_argument(
        *spellings("--no-python"), action="store_true", help="TARGET is any program, run as it is"
    )
    run.add_argument("target", nargs="?", metavar="TARGET", help="script.py, module, or program")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to TARGET")
    takes_value = frozenset(
        option for action in kept if action.nargs is None for option in action.option_strings
    )
    return top, takes_value


EPILOG = """\
targets:
  aiospawn run script.py ARGS            the script as __main__, sys.argv = [script.py, ARGS]
  aiospawn run -m package.module ARGS    the module as __main__, as python -m does
  aiospawn run --fn pkg.mod:func ARGS    func(rank, *ARGS), ARGS as strings
  aiospawn run --no-python prog ARGS     any program, in the rank's process group
  aiospawn run --ray HOST:6379 -n 8 script.py   the script as 8 ranks on a Ray cluster

environment of each rank:
  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR=127.0.0.1,
  MASTER_PORT (free when chosen), ROLE_NAME, TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE,
  TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, CUDA_VISIBLE_DEVICES with
  --devices-per-rank, OMP_NUM_THREADS=1 if unset and N > 1; --env wins. On Ray the
  local ranks, GROUP_RANK and MASTER_ADDR follow the placement.

error file:
  If TORCHELASTIC_ERROR_FILE is set for the launcher, a failed run writes the root
  cause's error there, in torchrun's JSON shape.

signals:
  SIGINT, SIGTERM, SIGHUP, SIGQUIT (or --signals-to-handle): SIGTERM to the ranks
  (another signal of --signals-to-handle is sent on first), grace period, SIGKILL;
  then exit 128 + signal (130 for Ctrl-C). A second Ctrl-C SIGKILLs the ranks at once.
  If the launcher dies, even by SIGKILL, its ranks die with it.

exit status:
  0 if every rank succeeded; else the failing rank's exit code, 128 + its signal,
  or 1 if it raised; 2 for bad usage. Failures end with a summary on stderr.
  If the launcher's output pipe closes (| head), it dies of SIGPIPE, ranks too.
"""
