"""Start methods, argument checks, and concurrent starts of a group's local ranks.

``Process.start()`` can block: under ``spawn`` and ``forkserver`` it writes the
pickled ``fn`` and ``args`` into a 64 KiB pipe and waits until the child has
read them, which happens only after the child has imported ``fn``'s module
(torch issue 133010). So those starts run on worker threads, side by side: N
ranks take about one rank's start time. A ``fork`` start never waits for the
child; those run on the event-loop thread, one at a time, with a checkpoint
between them. Each process object exists before its start, and starts are
never abandoned on cancellation, so no rank can start behind our back.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.lowlevel import checkpoint

from ._child import RESTART_COUNT_VAR, RankSetup, early_environment, run_rank
from ._outcome import RankExit
from ._output import CaptureBuffer, OutputSpec, RankOutput
from ._pipes import rank_pipe
from ._progress import RankProgress
from ._rendezvous import free_port, torchrun_environment
from ._watch import LocalRank

if TYPE_CHECKING:
    from ._backend import GroupLauncher, RankHandle

START_METHODS = ("spawn", "fork", "forkserver")

#: Parent-side file descriptors a running rank holds: sentinel, pidfd, result pipe,
#: plus one while it starts.
FDS_PER_RANK = 4

#: How many ranks of one group start at the same time. More threads would
#: fight the event loop for the GIL while they pickle and fork: with 32, a
#: 64-rank spawn start stalled the loop for about 200 ms, with 8 about 30 ms.
START_CONCURRENCY = 8


#: The environment of a group's ranks: one mapping for all, or one per rank.
EnvSpec = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """What every rank of a group runs, and how its process is made."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nprocs: int
    start_method: str
    daemon: bool
    env: EnvSpec
    output: OutputSpec
    torchrun_env: bool = False
    heartbeats: bool = False


def make_spec(
    fn: Callable[..., Any],
    args: Sequence[Any],
    nprocs: int,
    start_method: str | None,
    daemon: bool,
    *,
    env: EnvSpec = None,
    output: OutputSpec,
    torchrun_env: bool = False,
    heartbeats: bool = False,
    check_importable: bool = True,
) -> LaunchSpec:
    """Check a group's arguments before anything starts, and resolve the start method.

    Raises:
        TypeError: ``fn`` is not callable, or cannot reach a ``spawn`` or
            ``forkserver`` child (a lambda, a local function, a function of an
            interactive ``__main__``; checked with ``check_importable`` only);
            ``args`` is not a sequence; ``env`` is
            neither a mapping nor a callable.
        ValueError: ``nprocs`` is not a positive int within :func:`max_nprocs`,
            or ``start_method`` is unknown.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {args!r}")
    if env is not None and not (isinstance(env, Mapping) or callable(env)):
        raise TypeError(f"env must be a mapping, a callable rank -> mapping, or None, got {env!r}")
    check_nprocs(nprocs)
    method = resolve_start_method(start_method)
    if check_importable and method != "fork":
        _check_importable(fn, method)
    return LaunchSpec(
        fn=fn,
        args=tuple(args),
        nprocs=nprocs,
        start_method=method,
        daemon=bool(daemon),
        env=env,
        output=output,
        torchrun_env=bool(torchrun_env),
        heartbeats=heartbeats,
    )


def resolve_start_method(start_method: str | None) -> str:
    """Return the start method to use; ``None`` means the platform default."""
    if start_method is None:
        return multiprocessing.get_context().get_start_method()
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(map(repr, START_METHODS))} or None,"
            f" got {start_method!r}"
        )
    return start_method


def max_nprocs() -> int:
    """The largest group this process can hold, from its process and file limits.

    Each rank needs one process (``RLIMIT_NPROC``) and :data:`FDS_PER_RANK`
    descriptors here (``RLIMIT_NOFILE``, 64 kept for everything else).
    """
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    limits = [
        (nofile - 64) // FDS_PER_RANK if nofile != resource.RLIM_INFINITY else sys.maxsize,
        nproc if nproc != resource.RLIM_INFINITY else sys.maxsize,
    ]
    return max(1, min(limits))


def check_nprocs(nprocs: object) -> None:
    """Raise ValueError unless ``nprocs`` is a positive int this process can hold."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    limit = max_nprocs()
    if nprocs > limit:
        raise ValueError(
            f"nprocs={nprocs} is more than this process can supervise ({limit}, from"
            " RLIMIT_NOFILE and RLIMIT_NPROC); raise the limits (ulimit -n, ulimit -u)"
            " or start fewer ranks"
        )


def check_seconds(name: str, value: object, *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``value`` is a non-negative number of seconds (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number of seconds or None, got {value!r}")


def _check_importable(fn: Callable[..., Any], method: str) -> None:
    module = getattr(fn, "__module__", None)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if module == "__main__" and main_file is None:
        raise TypeError(
            f"fn {fn!r} is defined in an interactive __main__, which a {method!r} rank"
            " cannot import; move it to a module, or use start_method='fork'"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn {fn!r} cannot be pickled, so a {method!r} rank cannot receive it ({exc});"
            " define it at the top level of a module, or use start_method='fork'"
        ) from exc


class LocalBackend:
    """Runs a group's ranks as child processes of this one (the default backend)."""

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> GroupLauncher:
        """Return the launcher of the group ``spec``; nothing starts yet."""
        return LocalLauncher(spec, capture)


class LocalLauncher:
    """Makes and starts the local ranks of one group (see ``_backend.GroupLauncher``)."""

    def __init__(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> None:
        self._spec = spec
        self._capture = capture
        self._master_port: int | None = None
        self._fresh_port = True

    def make_rank(self, index: int, restart: int, on_exit: Callable[[RankExit], None]) -> LocalRank:
        """Create (without starting) attempt number ``restart`` of rank ``index``."""
        spec = self._spec
        # typeshed gives get_context(str) the BaseContext type, which lacks Process.
        context: Any = multiprocessing.get_context(spec.start_method)
        env = self._environment(index, restart)  # first: it runs the user's env callable
        reader, writer = rank_pipe()
        output = RankOutput(spec.output, index, self._capture, restart=restart)
        progress = RankProgress() if spec.heartbeats else None
        setup = RankSetup(
            supervisor_pid=os.getpid(),
            supervisor_is_parent=spec.start_method != "forkserver",
            env=env,
            stdout=output.targets["stdout"],
            stderr=output.targets["stderr"],
            restart=restart,
            heartbeat=progress.child_ends[0] if progress else None,
            stacks=progress.child_ends[1] if progress else None,
        )
        process = context.Process(
            target=run_rank,
            args=(spec.fn, index, spec.args, writer, setup),
            daemon=spec.daemon,
            name=(
                f"aiospawn-rank-{index}"
                if spec.start_method == "fork"
                else early_environment(f"aiospawn-rank-{index}", setup.env)
            ),
        )
        return LocalRank(
            index,
            process,
            reader,
            writer,
            output,
            exit_via_sentinel=spec.start_method == "forkserver",
            on_exit=on_exit,
            progress=progress,
        )

    async def start(self, ranks: Sequence[RankHandle]) -> None:
        """Start ``ranks``, made by :meth:`make_rank`, side by side (see :func:`start_ranks`)."""
        local = [rank for rank in ranks if isinstance(rank, LocalRank)]
        assert len(local) == len(ranks), "a local launcher starts the ranks it made"
        await start_ranks(local, self._spec.start_method)

    def new_rendezvous(self) -> None:
        """Pick a fresh ``MASTER_PORT``, not the last one, for the next ranks made."""
        self._fresh_port = True

    async def aclose(self) -> None:
        """Nothing to release: each rank releases its own descriptors when reaped."""

    def _environment(self, index: int, restart: int) -> dict[str, str]:
        spec = self._spec
        torchrun = None
        if spec.torchrun_env:
            if self._fresh_port:
                self._master_port = free_port(avoid=self._master_port)
                self._fresh_port = False
            assert self._master_port is not None
            torchrun = torchrun_environment(index, spec.nprocs, restart, self._master_port)
        return rank_environment(spec, index, restart, torchrun)


def rank_environment(
    spec: LaunchSpec, index: int, restart: int, torchrun: Mapping[str, str] | None
) -> dict[str, str]:
    """The environment of attempt ``restart`` of rank ``index``, on any backend.

    The restart count, then torchrun's variables if the group asked for them,
    then the user's ``env``, which wins.
    """
    env = {RESTART_COUNT_VAR: str(restart), **(torchrun or {})}
    user = spec.env(index) if callable(spec.env) else spec.env
    if user:
        env.update({str(key): str(value) for key, value in user.items()})
    return env


async def start_ranks(ranks: Sequence[LocalRank], start_method: str) -> None:
    """Start ``ranks`` side by side; return once every start has finished.

    Ranks whose start did not happen (an error, or a cancellation before their
    turn) have their pipes released. On cancellation, starts already under way
    finish first (threads are never abandoned), then the cancellation is raised.

    Raises:
        Exception: The start error of the lowest failing rank, with a note naming it.
    """
    errors: dict[int, Exception] = {}

    async def start_one(rank: LocalRank) -> None:
        try:
            await anyio.to_thread.run_sync(rank.start, limiter=limiter)
        except Exception as exc:
            errors[rank.rank] = exc

    try:
        if start_method == "fork":
            # A fork never waits for the child, so a worker thread would only
            # add a round trip per rank; fork on this thread, one at a time,
            # letting other tasks run in between.
            for rank in ranks:
                await checkpoint()
                try:
                    rank.start()
                except Exception as exc:
                    errors[rank.rank] = exc
        else:
            limiter = anyio.CapacityLimiter(START_CONCURRENCY)
            async with anyio.create_task_group() as tg:
                for rank in ranks:
                    tg.start_soon(start_one, rank)
    finally:
        for rank in ranks:
            if not rank.started:
                rank.discard()
    if errors:
        first = min(errors)
        error = errors[first]
        error.add_note(f"aiospawn: raised while starting rank {first} of {len(ranks)}")
        raise error
