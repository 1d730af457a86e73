"""The command line of ``aiospawn``: its flags, their checks, and its usage errors.

(About 600 lines, most of them the flag declarations and their help, which
are the command's reference; splitting them would scatter one table.)

:func:`parse` reads the command line into an :class:`argparse.Namespace`;
the type functions here check one value each, and :class:`UsageError` carries
any complaint out as one line on stderr with exit status 2, before anything starts.

torchrun's spellings are accepted beside ours (``--nproc-per-node`` and
``--nproc_per_node`` for ``--nprocs``, ...), so that a torchrun command line
usually runs with only the program name changed; its rendezvous flags, which
have no meaning here, parse too, so that :mod:`._plan` can refuse them with a
message instead of argparse's "unrecognized arguments". The docs' table
``docs/cli-torchrun.md`` lists what each one does.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import ClassVar, NoReturn

import aiospawn
from aiospawn._core._env import visible_devices
from aiospawn._core._spec import check_seconds

__all__ = [
    "EPILOG",
    "PROG",
    "SHUTDOWN_SIGNALS",
    "STREAM_MODES",
    "Std",
    "UsageError",
    "parse",
    "parser",
]

#: Signals that make the launcher shut the ranks down.
SHUTDOWN_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

STREAM_MODES = ("prefix", "inherit", "devnull")

#: ``--tee`` alone, aiospawn's older spelling: tee every stream that goes to files.
TEE_FILES = "files"

PROG = "aiospawn"


class UsageError(Exception):
    """Bad usage: reported as one line on stderr, exit status 2, nothing started."""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; :class:`UsageError` if it is bad.

    ``aiospawn`` alone prints the usage and exits 2 (``SystemExit``), and
    ``--version`` and ``--help`` print and exit 0, as argparse does.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    if not args:
        top.print_usage(sys.stderr)
        raise SystemExit(2)
    return top.parse_args(_tee_values(args, top))


def _tee_values(args: list[str], top: argparse.ArgumentParser) -> list[str]:
    """Spell ``-t``/``--tee`` with its value attached, before argparse sees it.

    torchrun's ``--tee`` takes a value (``3``, ``0:3,1:1``), aiospawn's takes
    none; a value is the next word only if it reads as one, so ``--tee
    script.py`` stays a bare ``--tee``. Only the options before TARGET are
    looked at: what follows it is the target's.
    """
    if not args or args[0] != "run":
        return args
    # argparse's own tables (stable since Python 3.2) say which options take a
    # value, so that an option's value is never mistaken for TARGET.
    run = _run_parser(top)
    takes_value = {
        option
        for action in run._actions
        if action.nargs is None and action.option_strings
        for option in action.option_strings
    }
    out = [args[0]]
    index = 1
    while index < len(args):
        word = args[index]
        index += 1
        if word in ("-t", "--tee"):
            if index < len(args) and STD_PATTERN.fullmatch(args[index]):
                out.append(f"--tee={args[index]}")
                index += 1
            else:
                out.append(f"--tee={TEE_FILES}")
            continue
        out.append(word)
        if word == "--" or not word.startswith("-"):
            break  # TARGET: the rest is its own
        if word in takes_value and index < len(args):
            out.append(args[index])
            index += 1
    return out + args[index:]


def _run_parser(top: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices["run"]
            return found
    raise AssertionError("the run command is missing")


def parser() -> argparse.ArgumentParser:
    """The ``aiospawn`` parser, with its ``run`` command."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise UsageError(message)

    parser = Parser(
        prog=PROG,
        description="Run a Python script, module, function or any program as N ranks,"
        " supervised by aiospawn.",
    )
    version = f"{PROG} {aiospawn.__version__}"
    parser.add_argument("--version", action="version", version=version)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "run",
        help="run a target as N ranks",
        description="Run TARGET as N ranks, each in a process of its own, supervised by\n"
        "aiospawn: the first rank to fail stops the others, and the launcher's exit\n"
        "status is that rank's. torchrun's flags are accepted in its spellings\n"
        "(--nproc_per_node, ...); its rendezvous flags are refused with the reason.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # After "run" too: that is where a user who just read "aiospawn run --help" types it.
    run.add_argument("--version", action="version", version=version)
    run.add_argument(
        *_spellings("-n", "--nprocs", "--nproc-per-node"),
        dest="nprocs",
        type=_nprocs,
        default=1,
        metavar="N",
        help="number of ranks; 'cpu' for one per CPU, 'gpu' for one per visible GPU, 'auto'"
        " for one per visible GPU if there is any, else one per CPU (default: 1)",
    )
    run.add_argument(
        *_spellings("--start-method"),
        choices=("spawn", "forkserver", "fork"),
        default="spawn",
        help="how rank processes are made (default: spawn)",
    )
    run.add_argument(
        *_spellings("--run-path"),
        action="store_true",
        help="torchrun's: run the script in the rank's interpreter (what aiospawn always does)",
    )

    shutdown = run.add_argument_group("shutdown and restarts")
    shutdown.add_argument(
        "--grace-period",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="after a failure, how long the other ranks may take to exit, and the wait from"
        " SIGTERM to SIGKILL (default: no wait after a failure, 30 s to SIGKILL)",
    )
    shutdown.add_argument(
        *_spellings("--shutdown-timeout"),
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="torchrun's: the wait from SIGTERM to SIGKILL; as --grace-period (default:"
        " $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    )
    shutdown.add_argument(
        *_spellings("--signals-to-handle"),
        type=_signal_list,
        default=None,
        metavar="SIGNALS",
        help="signals that stop the run, comma-separated (default:"
        f" {','.join(SHUTDOWN_SIGNALS)}); any other is sent on to the ranks first, which"
        " then have the shutdown timeout to exit (SIGUSR1 for SLURM preemption)",
    )
    shutdown.add_argument(
        *_spellings("--max-restarts"),
        type=_count,
        default=0,
        metavar="N",
        help="restart ranks when one fails, up to N times (default 0)",
    )
    shutdown.add_argument(
        "--restart-window",
        type=_seconds,
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
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="wait before the first restart, doubled for each quick restart after it, at"
        " most 30 s or SECONDS (default 0.5)",
    )
    shutdown.add_argument(
        "--heartbeat-timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a rank that called aiospawn.heartbeat() and then goes SECONDS without it is"
        " hung: its stacks are printed and it fails (or restarts)",
    )
    shutdown.add_argument(
        "--startup-timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a rank that has not called aiospawn.heartbeat() SECONDS after it started is hung",
    )

    output = run.add_argument_group("output")
    for stream in ("stdout", "stderr"):
        output.add_argument(
            f"--{stream}",
            type=_stream_mode,
            default=None,
            metavar="MODE",
            help=f"prefix, inherit, devnull or a directory (files rankN.{stream}); default:"
            " prefix with more than one rank, else inherit",
        )
    output.add_argument(
        *_spellings("--log-dir"),
        default=None,
        metavar="DIR",
        help="both streams to files in DIR; with -r or -t, only where their files go",
    )
    output.add_argument(
        *_spellings("-r", "--redirects"),
        type=_std,
        default=None,
        metavar="STD",
        help="torchrun's: streams to files in --log-dir: 0 none, 1 stdout, 2 stderr, 3 both;"
        " or per rank, 0:3,1:1",
    )
    output.add_argument(
        "-t",
        "--tee",
        type=_tee,
        default=None,
        metavar="STD",
        help="streams to files and the terminal, as for -r; alone: tee every stream that goes"
        " to files",
    )
    output.add_argument(
        *_spellings("--local-ranks-filter"),
        type=_rank_list,
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

    ranks = run.add_argument_group("each rank's environment")
    ranks.add_argument(
        "--env",
        action="append",
        type=_env_pair,
        default=[],
        metavar="KEY[=VALUE]",
        help="set a variable in every rank (repeatable); KEY alone: its value here, which keeps"
        " a secret out of the command line",
    )
    ranks.add_argument(
        "--preload",
        type=_module_list,
        default=None,
        metavar="MODULES",
        help="comma-separated modules (torch,mypkg.model) imported once in a template"
        " that every rank is forked from (warm starts)",
    )
    ranks.add_argument(
        "--devices-per-rank",
        type=_count,
        default=None,
        metavar="N",
        help="give each rank N devices of its own in CUDA_VISIBLE_DEVICES (0: none); on Ray,"
        " N GPUs per rank",
    )
    ranks.add_argument(
        "--devices",
        type=_device_list,
        default=None,
        metavar="IDS",
        help="the devices to share out, e.g. 0,1,2,3 (default: the visible ones)",
    )
    ranks.add_argument(
        *_spellings("--virtual-local-rank"),
        action="store_true",
        help="torchrun's: LOCAL_RANK=0 in every rank, each with one device of its own",
    )
    ranks.add_argument(
        "--role", default="default", metavar="NAME", help="ROLE_NAME, and the line prefix"
    )
    ranks.add_argument(
        *_spellings("--run-id", "--rdzv-id"),
        default=None,
        metavar="ID",
        help="TORCHELASTIC_RUN_ID (default: a new random id)",
    )

    ray = run.add_argument_group("on a Ray cluster")
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

    single = run.add_argument_group(
        "torchrun's rendezvous (one machine, or --ray: accepted as they say so, else refused)"
    )
    single.add_argument("--standalone", action="store_true", help="accepted: what aiospawn does")
    for name, metavar in (
        ("--nnodes", "1"),
        ("--node-rank", "0"),
        ("--master-addr", "HOST"),
        ("--master-port", "PORT"),
        ("--monitor-interval", "SECONDS"),
        ("--rdzv-backend", "NAME"),
        ("--rdzv-endpoint", "HOST:PORT"),
        ("--rdzv-conf", "CONF"),
        ("--local-addr", "HOST"),
        ("--logs-specs", "NAME"),
        ("--duplicate-stdout-filters", "TEXT"),
        ("--duplicate-stderr-filters", "TEXT"),
        ("--numa-binding", "MODE"),
    ):
        single.add_argument(
            *_spellings(name), default=None, metavar=metavar, help=argparse.SUPPRESS
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
        *_spellings("--no-python"), action="store_true", help="TARGET is any program, run as it is"
    )
    run.add_argument("target", nargs="?", metavar="TARGET", help="script.py, module, or program")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to TARGET")
    return parser


def _spellings(*names: str) -> list[str]:
    """Each option name, and torchrun's underscore spelling of it where that differs."""
    spelled = []
    for name in names:
        spelled.append(name)
        if name.startswith("--") and "-" in name[2:]:
            spelled.append("--" + name[2:].replace("-", "_"))
    return spelled


#: More ranks than this get the status line by default on a terminal.
STATUS_RANKS = 4

#: torchrun's Std values: one for all ranks (``3``), or per rank (``0:3,1:1``).
STD_PATTERN = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")


class Std:
    """A torchrun stream choice: 0 none, 1 stdout, 2 stderr, 3 both; per rank or for all."""

    NAMES: ClassVar[dict[int, str]] = {1: "stdout", 2: "stderr"}

    def __init__(self, default: int, per_rank: dict[int, int]) -> None:
        self.default = default
        self.per_rank = per_rank

    def streams(self, rank: int) -> frozenset[str]:
        """The streams this choice names for ``rank``."""
        value = self.per_rank.get(rank, self.default)
        return frozenset(name for bit, name in self.NAMES.items() if value & bit)

    def __repr__(self) -> str:
        return f"Std({self.default}, {self.per_rank})"


def _std(text: str) -> Std:

    if not STD_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"wants 0, 1, 2 or 3 (none, stdout, stderr, both), or per rank as 0:3,1:1; got {text!r}"
        )
    if ":" not in text:
        return Std(int(text), {})
    per_rank: dict[int, int] = {}
    for item in text.split(","):
        rank, _, value = item.partition(":")
        if int(rank) in per_rank:
            raise argparse.ArgumentTypeError(f"names rank {int(rank)} twice: {text!r}")
        per_rank[int(rank)] = int(value)
    # torchrun: a rank the map leaves out gets 0 (nothing).
    return Std(0, per_rank)


def _tee(text: str) -> Std | str:

    return TEE_FILES if text == TEE_FILES else _std(text)


def _rank_list(text: str) -> frozenset[int]:

    items = text.split(",")
    if not all(item.strip().isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"wants ranks such as 0 or 0,3, got {text!r}")
    return frozenset(int(item) for item in items)


def _device_list(text: str) -> list[str]:

    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"wants device ids such as 0,1,2,3, got {text!r}")
    return items


def _signal_list(text: str) -> list[signal.Signals]:

    signums: list[signal.Signals] = []
    for item in text.split(","):
        name = item.strip().upper()
        if name and not name.startswith("SIG"):
            name = "SIG" + name
        value = getattr(signal, name, None)
        if not isinstance(value, signal.Signals) or value in (signal.SIGKILL, signal.SIGSTOP):
            raise argparse.ArgumentTypeError(
                f"wants signal names such as SIGTERM,SIGUSR1 (not SIGKILL or SIGSTOP),"
                f" got {item.strip()!r}"
            )
        signums.append(value)
    return signums


def _positive_seconds(text: str) -> float:

    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("wants more than 0 seconds")
    return value


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


def _nprocs(text: str) -> int:

    if text == "gpu" or (text == "auto" and visible_devices()):
        gpus = len(visible_devices())
        if not gpus:
            raise argparse.ArgumentTypeError("'gpu' wants GPUs, and none is visible here")
        return gpus
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants a positive integer, 'auto', 'cpu' or 'gpu', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"wants a positive integer, 'auto', 'cpu' or 'gpu', got {text!r}"
        )
    return value


def _seconds(text: str) -> float:

    try:
        value = float(text)
        check_seconds("SECONDS", value, allow_none=False, finite=True)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants a non-negative number of seconds, got {text!r}"
        ) from None
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
    if text not in STREAM_MODES and not _names_a_directory(text):
        # A bare word that is no mode is far more often a typo (--stdout prefx)
        # than a directory to make; a path says it is one.
        close = difflib.get_close_matches(text, STREAM_MODES, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a mode ({', '.join(STREAM_MODES)}) nor an existing"
            f" directory; {guess}for a new directory, give a path: ./{text}"
        )
    return text


def _names_a_directory(text: str) -> bool:
    """True if a ``--stdout``/``--stderr`` value is a directory: one that exists, or a path."""
    separators = {os.sep} | ({os.altsep} if os.altsep else set())
    return os.path.isdir(text) or any(sep in text for sep in separators)


def _module_list(text: str) -> list[str]:
    """``--preload`` value: comma-separated module names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected module names separated by commas, got {text!r}")
    return names


def _env_pair(text: str) -> tuple[str, str]:

    key, equals, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE or KEY, got {text!r}")
    if not equals:
        # The value from our own environment: a secret given on the command
        # line is in our argv, which every local user can read (ps).
        if key not in os.environ:
            raise argparse.ArgumentTypeError(
                f"{key} is not set in the launcher's environment (--env KEY takes its value"
                " from there)"
            )
        value = os.environ[key]
    return key, value
