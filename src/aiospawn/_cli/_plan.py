"""A checked ``aiospawn run`` command line: what to start, and how.

Everything that can be refused is refused here, before anything starts:
torchrun's rendezvous flags (with the reason), options that contradict each
other, and what the backend cannot run (too many ranks, devices that do not
fit, ``--preload`` where no template can be): the group the command line
describes goes through the library's own checks (``make_spec``, then the
backend's ``check``), whose messages are put in the command line's words
(:func:`_cli_spelling`). The output options, in aiospawn's spelling
(``--stdout``, ``--log-dir``, ``--tee``) or torchrun's (``-r``, ``-t``,
``--local-ranks-filter``), become one mode per rank and stream.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import math
import os
import re
import signal
import uuid
from typing import TYPE_CHECKING

import aiospawn
from aiospawn._core._env import visible_devices
from aiospawn._core._spec import DEFAULT_PREFIX, make_output_spec, make_spec

from ._nodes import (
    Nodes,
    ignored_flags,
    one_machine_port,
    read_nodes,
    read_pet_environment,
    refuse_other_machines,
)
from ._parse import SHUTDOWN_SIGNALS, UsageError
from ._target import search_target_directory, target
from ._torchrun import Std
from ._values import STREAM_MODES, seconds

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Plan"]


#: Variables ending so are thread counts of native libraries (OMP_NUM_THREADS,
#: MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, ...), read as the library loads.
THREAD_SUFFIX = "_NUM_THREADS"


class Plan:
    """A checked ``aiospawn run`` command line: what to start and how.

    Raises:
        UsageError: The command line asks for something aiospawn cannot do,
            or is inconsistent; the message says why and what to do instead.
    """

    def __init__(self, options: argparse.Namespace) -> None:
        read_pet_environment(options)
        #: The rendezvous of several nodes to join, or None for one machine.
        self.nodes: Nodes | None = read_nodes(options)
        self.ignored: list[str] = [] if self.nodes is None else ignored_flags(options, self.nodes)
        _refuse_rendezvous(options, several_nodes=self.nodes is not None)
        # Across nodes a restart is a new round on every node, made by the
        # launcher, not by the local group's own restarts.
        self.restart = None if self.nodes is not None else _restart_policy(options)
        if options.target is None:
            raise UsageError(
                "missing TARGET: a script, -m module, --fn module:function or --no-python program"
            )
        self.nprocs: int = options.nprocs
        self.start_method: str = options.start_method
        self.preload: list[str] | None = options.preload
        search_target_directory(options)
        for name in self.preload or ():
            # As --fn's module is checked: a typo is a usage error, not a failed start.
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise UsageError(f"--preload {name}: no module named {name!r} here")
        self.grace_period = _grace_period(options)
        self.heartbeat_timeout: float | None = options.heartbeat_timeout
        self.startup_timeout: float | None = options.startup_timeout
        self.verbose: bool = options.verbose
        self.role: str = options.role
        self.run_id: str = (
            self.nodes.run_id if self.nodes is not None else options.run_id or uuid.uuid4().hex
        )
        self.ray: str | None = options.ray
        if options.placement is not None and self.ray is None:
            raise UsageError("--placement is for --ray ADDRESS")
        self.placement: str = options.placement or "PACK"
        self.signals: list[signal.Signals] = options.signals_to_handle or [
            getattr(signal, name) for name in SHUTDOWN_SIGNALS
        ]
        if self.ray is not None and set(self.signals) - _signal_numbers(SHUTDOWN_SIGNALS):
            raise UsageError(
                "--signals-to-handle with --ray: only SIGINT, SIGTERM, SIGHUP and SIGQUIT,"
                " which stop the ranks; other signals cannot be passed on to Ray's workers"
            )
        self.fn, self.args, self.name = target(options, absolute=self.ray is not None)
        self.status: bool | None = options.status
        self.devices_per_rank, self.devices = _devices(options)
        self.virtual_local_rank: bool = options.virtual_local_rank
        self._output(options)
        self._check_backend()
        # Beside the torchrun_env variables; --env wins over both.
        self.user_env = dict(options.env)
        self.omp_note = (
            self.nprocs > 1
            and "OMP_NUM_THREADS" not in os.environ
            and "OMP_NUM_THREADS" not in self.user_env
        )
        base = {
            "ROLE_NAME": self.role,
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_MAX_RESTARTS": str(options.max_restarts),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(
                signal.Signals(signum).name for signum in self.signals
            ),
        }
        if self.nodes is None:
            port = one_machine_port(options)
            if port is not None:
                base["MASTER_PORT"] = str(port)
        if self.virtual_local_rank:
            base["LOCAL_RANK"] = "0"
        if self.omp_note:
            base["OMP_NUM_THREADS"] = "1"
        self.base_env = base
        #: What a warm template's environment must hold when it imports the
        #: preload: the thread counts every rank gets. Native libraries read
        #: them as they load (OpenMP's, OpenBLAS's, MKL's), which with
        #: --preload happens in the template, before the rank's env is set.
        self.template_env: dict[str, str] = {}
        if self.preload:
            shared = {**base, **self.user_env}
            self.template_env = {
                key: value for key, value in shared.items() if key.endswith(THREAD_SUFFIX)
            }

    def environment(
        self,
        error_files: str | None,
        round_env: Callable[[int], dict[str, str]] | None = None,
    ) -> Callable[[int], dict[str, str]]:
        """Each rank's variables beyond torchrun's: ours, then ``--env``, which wins.

        Args:
            error_files: The stem of the ranks' ``TORCHELASTIC_ERROR_FILE``
                paths (see :func:`error_file`), or None to set none.
            round_env: With several nodes, torchrun's variables of the
                rendezvous round for each local rank; they replace the ones
                the library sets for one machine.
        """

        def env(rank: int) -> dict[str, str]:
            variables = {} if round_env is None else round_env(rank)
            variables.update(self.base_env)
            if error_files is not None:
                path = error_file(error_files, rank)
                # Called as each attempt of the rank is made: an earlier
                # attempt's file must not pass for this one's.
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                variables["TORCHELASTIC_ERROR_FILE"] = path
            variables.update(self.user_env)
            return variables

        return env

    def stream_modes(self) -> tuple[Callable[[int], str], Callable[[int], str]]:
        """The ``stdout`` and ``stderr`` options of the group: each rank's mode."""
        return (lambda rank: self.streams(rank)["stdout"]), (
            lambda rank: self.streams(rank)["stderr"]
        )

    def _check_backend(self) -> None:
        """Refuse what the backend cannot run, as the start would, but first.

        A usage error must come before any note, and before anything starts.
        """
        stdout, stderr = self.stream_modes()
        try:
            spec = make_spec(
                self.fn,
                self.args,
                self.nprocs,
                self.start_method,
                False,
                output=make_output_spec(stdout, stderr, self.teed, self.prefix),
                torchrun_env=True,
                heartbeats=self.heartbeat_timeout is not None or self.startup_timeout is not None,
                preload=self.preload,
                devices_per_rank=self.devices_per_rank,
                devices=self.devices,
            )
            if self.ray is None:
                from aiospawn._local._backend import LocalBackend

                LocalBackend().check(spec)
            else:
                # Not a RayBackend: its refusals need no Ray, making one does.
                from aiospawn.ray import check_group

                check_group(spec)
        except (TypeError, ValueError) as exc:
            raise UsageError(_cli_spelling(str(exc))) from None

    def _output(self, options: argparse.Namespace) -> None:
        """Where each rank's streams go, in aiospawn's spelling or torchrun's."""
        console = "prefix" if self.nprocs > 1 else "inherit"
        shown: frozenset[int] | None = options.local_ranks_filter
        if shown is not None and not shown <= set(range(self.nprocs)):
            raise UsageError(
                f"--local-ranks-filter names ranks {sorted(shown - set(range(self.nprocs)))},"
                f" but the ranks are 0..{self.nprocs - 1}"
            )
        torchrun = options.redirects is not None or isinstance(options.tee, Std)
        if self.ray is not None:
            given = [
                flag
                for flag, value in (
                    ("--stdout", options.stdout),
                    ("--stderr", options.stderr),
                    ("--log-dir", options.log_dir),
                    ("-r/--redirects", options.redirects),
                    ("-t/--tee", options.tee),
                    ("--local-ranks-filter", shown),
                )
                if value is not None
            ]
            if given:
                raise UsageError(
                    f"{given[0]} with --ray: Ray sends each rank's output to the launcher"
                    " itself, behind the rank's prefix (the files are in Ray's session logs)"
                )
            self.streams: Callable[[int], dict[str, str]] = lambda rank: {
                "stdout": "inherit",
                "stderr": "inherit",
            }
            self.teed: Callable[[int], frozenset[str]] = lambda rank: frozenset()
            self.prefix = ""
            return
        if self.role != "default":
            self.prefix = f"[{self.role}{{rank}}]: "
        else:
            self.prefix = DEFAULT_PREFIX
        log_dir: str | None = options.log_dir
        if torchrun:
            if options.stdout is not None or options.stderr is not None:
                raise UsageError(
                    "--stdout/--stderr and -r/--redirects or -t VALUE say the same thing: use one"
                )
            redirects: Std = options.redirects or Std(0, {})
            tee: Std = options.tee if isinstance(options.tee, Std) else Std(0, {})
            if log_dir is None and any(
                redirects.streams(rank) - tee.streams(rank) for rank in range(self.nprocs)
            ):
                raise UsageError(
                    "-r/--redirects needs --log-dir DIR for the files (torchrun would pick"
                    " a temporary directory and keep it)"
                )

            def torchrun_streams(rank: int) -> dict[str, str]:
                to_files = redirects.streams(rank) | tee.streams(rank)
                modes: dict[str, str] = {}
                for name in ("stdout", "stderr"):
                    if name in to_files and log_dir is not None:
                        modes[name] = log_dir
                    elif shown is None or rank in shown:
                        modes[name] = console
                    else:
                        modes[name] = "devnull"
                return modes

            def torchrun_teed(rank: int) -> frozenset[str]:
                if log_dir is None or (shown is not None and rank not in shown):
                    return frozenset()
                return tee.streams(rank)

            self.streams, self.teed = torchrun_streams, torchrun_teed
            return
        stdout: str = options.stdout or log_dir or console
        stderr: str = options.stderr or log_dir or console
        if options.tee is not None and all(mode in STREAM_MODES for mode in (stdout, stderr)):
            raise UsageError("--tee needs --log-dir DIR, or a directory for --stdout or --stderr")

        def aiospawn_streams(rank: int) -> dict[str, str]:
            hidden = shown is not None and rank not in shown
            modes: dict[str, str] = {"stdout": stdout, "stderr": stderr}
            if hidden:
                modes = {
                    name: "devnull" if mode in ("prefix", "inherit") else mode
                    for name, mode in modes.items()
                }
            return modes

        def aiospawn_teed(rank: int) -> frozenset[str]:
            if options.tee is None or (shown is not None and rank not in shown):
                return frozenset()
            return frozenset(
                name
                for name, mode in (("stdout", stdout), ("stderr", stderr))
                if mode not in STREAM_MODES
            )

        self.streams, self.teed = aiospawn_streams, aiospawn_teed


def error_file(stem: str, rank: int) -> str:
    """Where rank ``rank`` may write its torchrun error file: ``{stem}-rank{rank}.error.json``."""
    return f"{stem}-rank{rank}.error.json"


def _signal_numbers(names: tuple[str, ...]) -> set[int]:
    return {int(getattr(signal, name)) for name in names}


def _refuse_rendezvous(options: argparse.Namespace, *, several_nodes: bool) -> None:
    """Refuse the rendezvous flags that ask for what we do not do.

    With several nodes, ``_nodes.read_nodes`` has judged the rendezvous's own
    flags; on one machine only the values that describe one machine pass.
    """
    if not several_nodes:
        refuse_other_machines(options)
    for flag, value, why in (
        ("--logs-specs", options.logs_specs, "use --log-dir, -r/--redirects and -t/--tee"),
        (
            "--duplicate-stdout-filters",
            options.duplicate_stdout_filters,
            "aiospawn has no filtered copies; use -t/--tee with --log-dir and grep the files",
        ),
        (
            "--duplicate-stderr-filters",
            options.duplicate_stderr_filters,
            "aiospawn has no filtered copies; use -t/--tee with --log-dir and grep the files",
        ),
        (
            "--numa-binding",
            options.numa_binding,
            "aiospawn does not bind ranks to NUMA nodes; run TARGET under numactl with --no-python",
        ),
    ):
        if value is not None:
            raise UsageError(f"{flag} {value}: {why}")
    if options.monitor_interval is not None:
        try:
            float(options.monitor_interval)
        except ValueError:
            raise UsageError(
                f"--monitor-interval wants seconds, got {options.monitor_interval!r}"
            ) from None


def _restart_policy(options: argparse.Namespace) -> aiospawn.RestartPolicy | None:

    if options.restart_window is not None and not options.max_restarts:
        raise UsageError("--restart-window needs --max-restarts N, N > 0")
    if options.restart_window == 0:
        raise UsageError("--restart-window must be more than 0 seconds")
    for flag, value in (
        ("--restart-strategy", options.restart_strategy),
        ("--restart-backoff", options.restart_backoff),
    ):
        if value is not None and not options.max_restarts:
            raise UsageError(f"{flag} needs --max-restarts N, N > 0")
    if not options.max_restarts:
        return None
    backoff = aiospawn.Backoff()
    if options.restart_backoff is not None:
        backoff = aiospawn.Backoff(
            initial=options.restart_backoff, max=max(backoff.max, options.restart_backoff)
        )
    return aiospawn.RestartPolicy(
        max_restarts=options.max_restarts,
        window=options.restart_window or math.inf,
        backoff=backoff,
        strategy=options.restart_strategy or "one_for_all",
    )


def _grace_period(options: argparse.Namespace) -> float | None:

    if options.grace_period is not None and options.shutdown_timeout is not None:
        raise UsageError(
            "--grace-period and --shutdown-timeout both set the wait from SIGTERM to SIGKILL:"
            " give one"
        )
    if options.grace_period is not None:
        grace: float = options.grace_period
        return grace
    if options.shutdown_timeout is not None:
        timeout: float = options.shutdown_timeout
        return timeout
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if text:  # torchrun's own default comes from there
        try:
            return seconds(text)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT {exc}") from None
    return None


def _devices(options: argparse.Namespace) -> tuple[int | None, list[str] | None]:

    per_rank: int | None = options.devices_per_rank
    devices: list[str] | None = options.devices
    if options.virtual_local_rank:
        if per_rank not in (None, 1):
            raise UsageError(
                "--virtual-local-rank gives each rank one device: drop --devices-per-rank"
            )
        per_rank = 1
        if devices is None and not visible_devices():
            # As torchrun does with no CUDA_VISIBLE_DEVICES: rank r sees device r.
            devices = [str(rank) for rank in range(options.nprocs)]
    return per_rank, devices


#: The library's option names, as the command line spells them.
FLAGS = {
    "nprocs": "-n",
    "start_method": "--start-method",
    "preload": "--preload",
    "devices_per_rank": "--devices-per-rank",
    "devices": "--devices",
    "heartbeat_timeout": "--heartbeat-timeout",
    "startup_timeout": "--startup-timeout",
}

#: An option name, alone or as ``name=value`` (a value is a number, a quoted
#: string or a list); not part of a longer name, nor already a flag.
_OPTION = re.compile(
    rf"(?<![\w-])({'|'.join(sorted(FLAGS, key=len, reverse=True))})"
    r"(?:=(\[[^\]]*\]|'[^']*'|[^\s,;:)]+)?)?(?![\w=])"
)


def _cli_spelling(message: str) -> str:
    """A refusal of the library's, in the command line's words: flags for options.

    ``start_method='fork'`` becomes ``--start-method fork``, ``preload=``
    becomes ``--preload``, ``RayBackend`` becomes ``--ray``. Alone, a name is
    taken for its option unless it is also a plain word ("devices").
    """

    def flag(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if "=" not in match.group(0) and name == "devices":
            return match.group(0)
        if value is None:
            return FLAGS[name]
        with contextlib.suppress(ValueError, SyntaxError):
            parsed = ast.literal_eval(value)
            if isinstance(parsed, list | tuple):
                value = ",".join(map(str, parsed))
            elif isinstance(parsed, str):
                value = parsed
        return f"{FLAGS[name]} {value}"

    message = _OPTION.sub(flag, message)
    return message.replace("RayBackend", "--ray").replace(
        "name the devices to use", "name them with --devices"
    )
