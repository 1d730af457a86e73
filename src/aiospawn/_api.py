"""The async entry points: ``start_processes``, ``spawn`` and ``open_group``.

The supervisor's modules are imported by the first call, not with this
module, and on a worker thread (``_imports``): a first ``forkserver`` call
starts the fork server as soon as its arguments are checked, and imports them
while the server starts up (the local backend's ``prepare``). The arguments
are checked twice over, before anything starts: what every backend requires
(``_core._spec.make_spec``), then what the chosen backend can run
(``Backend.check``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    TypedDict,
    TypeVar,
    TypeVarTuple,
    Unpack,
    overload,
)

from ._core._notebook import default_stream_mode, signals_wake_the_loop
from ._imports import CHECKS, SUPERVISOR, import_off_the_loop

if TYPE_CHECKING:
    from ._core._backend import Backend
    from ._core._context import AsyncProcessContext
    from ._core._policy import RestartPolicy
    from ._core._spec import EnvSpec

__all__ = ["GroupOptions", "open_group", "spawn", "start_processes"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class GroupOptions(TypedDict, total=False):
    """Keyword-only options of :func:`start_processes`, :func:`spawn` and :func:`open_group`.

    Attributes:
        grace_period: The group's default seconds between SIGTERM and SIGKILL
            during a shutdown, and after a failure, how long the other ranks
            may first take to exit by themselves. ``None`` (the default): no
            such wait, and :data:`DEFAULT_GRACE_PERIOD` (30 s) between SIGTERM
            and SIGKILL.
        env: Environment variables set in each rank: one mapping for every
            rank, or a callable ``rank -> mapping``. Under ``spawn`` they are
            set before the rank imports anything of the user's (the main
            script, ``fn``'s module); under ``forkserver`` before it imports
            ``fn``'s module (the fork server imported the main script when it
            started); under ``fork`` before ``fn`` runs. Every rank also gets
            ``AIOSPAWN_RESTART_COUNT``.
        torchrun_env: Set the variables torchrun sets (``RANK``,
            ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
            ``GROUP_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``: a free
            port chosen at each start of the whole group,
            ``TORCHELASTIC_RESTART_COUNT``, ...), so code written for torchrun
            runs unchanged. ``env`` wins over them.
        restart: A :class:`RestartPolicy`: start failed ranks (or the whole
            group) again instead of failing. ``None`` (the default): the first
            failure is raised.
        heartbeat_timeout: Seconds a rank may go without calling
            :func:`aiospawn.heartbeat` once it has called it; a rank that
            overruns it is hung: its threads' stacks are taken, and it fails
            with :class:`ProcessHungException` (or is restarted). ``None``
            (the default): no hang detection.
        startup_timeout: Seconds a rank may take to send its first heartbeat;
            ``None`` (the default): a rank that never beats is never hung.
        backend: Where the ranks run: local processes (the default), or
            ``aiospawn.ray.RayBackend(...)`` for a Ray cluster.
        stdout: Where each rank's stdout goes: ``"inherit"`` (the default;
            under ipykernel ``"prefix"``, so that the lines appear in the cell
            that started the group), ``"prefix"`` (the supervisor's
            ``sys.stdout``, each line behind ``prefix``), ``"capture"`` (kept for
            ``ctx.output()``, so only with ``open_group`` or ``join=False``),
            ``"devnull"``, or a directory path (one file per rank,
            ``rank{N}.stdout``, mode 0600, emptied at each start of the rank,
            never deleted; the directory and its missing parents are made with
            mode 0700, and links are never followed); or a callable ``rank -> mode`` for a mode
            per rank.
        stderr: The same for stderr (files ``rank{N}.stderr``). With ``prefix``,
            ``capture`` or ``tee``, a failed rank's exception quotes its last
            20 stderr lines.
        tee: With a directory path: also write each line to the supervisor's
            stream, behind ``prefix``. True tees every stream that goes to a
            directory; a collection of stream names (``{"stdout"}``) only
            those; a callable ``rank -> bool | names`` chooses per rank.
        devices_per_rank: Give each rank this many devices of its own: rank
            ``r`` gets the ``r``-th run of them from ``devices``, in its
            ``CUDA_VISIBLE_DEVICES`` (0: none). On a Ray backend it is each
            rank's ``num_gpus``, and Ray sets the variable. ``None`` (the
            default): the ranks see the devices this process sees.
        devices: The devices to share out (ids such as ``0`` or ``"GPU-..."``);
            by default those this process sees (``CUDA_VISIBLE_DEVICES``, else
            every GPU the NVIDIA driver lists). Without ``devices_per_rank``
            they are split evenly over the ranks. Local processes only.
        prefix: The template of the line prefix, with ``{rank}``, ``{pid}`` and
            ``{restart}``; default ``"[rank{rank}]: "``.
        preload: Warm starts: module names (``["torch", "mypkg.model"]``) that
            a template process imports once; every rank, and every restart, is
            then forked from it and finds them imported. The template is spawned
            (a fresh interpreter with this process's ``sys.path``, ``sys.argv``
            and main script, as under ``forkserver``), shared by the groups of
            this process with the same list, ``sys.path`` and environment, and
            stopped once idle (the docs' warm-starts page says when) or when
            this process exits. It refuses, with
            :class:`RuntimeError`, a preload that leaves threads running or
            CUDA initialised. With ``spawn`` (the default) or ``forkserver``;
            not with ``fork``. Preloaded modules see the template's environment
            and ``sys.argv``, not a rank's ``env`` (the docs' warm-starts page).
        rank_loop: The event loop an ``async def fn`` runs on in its rank:
            ``"asyncio"`` (the default), ``"trio"`` or ``"uvloop"`` (each
            must be installed). A sync ``fn`` runs on no loop.
    """

    grace_period: float | None
    env: EnvSpec
    torchrun_env: bool
    restart: RestartPolicy | None
    heartbeat_timeout: float | None
    startup_timeout: float | None
    backend: Backend | None
    stdout: str | os.PathLike[str] | Callable[[int], str | os.PathLike[str]]
    stderr: str | os.PathLike[str] | Callable[[int], str | os.PathLike[str]]
    tee: bool | Collection[str] | Callable[[int], bool | Collection[str]]
    prefix: str
    devices_per_rank: int | None
    devices: Sequence[int | str] | None
    preload: Sequence[str] | None
    rank_loop: str


@overload
async def start_processes(
    fn: Callable[[int, *Ts], T],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    join: Literal[True] = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> list[T]: ...


@overload
async def start_processes(
    fn: Callable[[int, *Ts], T],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> AsyncProcessContext[T]: ...


@overload
async def start_processes(
    fn: Callable[[int, *Ts], T],
    args: tuple[*Ts],
    nprocs: int,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> AsyncProcessContext[T]: ...


async def start_processes(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> list[Any] | AsyncProcessContext[Any]:
    """Start ``nprocs`` processes, each running ``fn(rank, *args)`` for rank 0..nprocs-1.

    The ranks start side by side on worker threads, so N ranks whose start
    blocks (a large ``args``, a slow import) take about one rank's start time.
    Each rank leads its own process group, and dies with its process group as
    soon as the supervising process is gone, even if it was SIGKILLed.

    Args:
        fn: A function taking the rank first. Under ``spawn`` and
            ``forkserver``, a function the rank can import goes by reference;
            a lambda, a local function, or one defined in a notebook cell or
            another interactive ``__main__`` goes by value (cloudpickle).
        args: Further positional arguments for ``fn``; pickled under ``spawn``
            and ``forkserver``, which may carry ``multiprocessing`` queues and
            pipes as usual.
        nprocs: How many ranks; a positive int, at most what the process and
            file limits allow (the docs' semantics page, "Starting ranks").
        join: Wait for every rank and return their results (True), or return
            the :class:`AsyncProcessContext` at once (False).
        daemon: Start the processes as daemons (they cannot have children).
        start_method: ``"spawn"``, ``"fork"``, ``"forkserver"``, or ``None``
            for the platform default. Under ``"forkserver"`` the first call
            starts ``multiprocessing``'s fork server once the arguments are
            checked (it is shared by every forkserver start of the process
            and ends with it, as in ``multiprocessing``), so it may be
            running when a later check, of an output directory or an ``env``
            callable's result, refuses the group.
        **options: Keyword-only group options (:class:`GroupOptions`):
            ``grace_period``, ``env``, ``torchrun_env``, ``restart``,
            ``heartbeat_timeout``, ``startup_timeout``, ``backend``,
            ``stdout``, ``stderr``, ``tee``, ``prefix``, ``devices_per_rank``,
            ``devices``, ``preload``.

    Returns:
        With ``join=True``, the list of return values, index = rank; with
        ``join=False``, the group's :class:`AsyncProcessContext`.

    Raises:
        ProcessRaisedException: A rank's ``fn`` raised (``join=True``).
        ProcessExitedException: A rank exited with a non-zero code or was
            killed by a signal (``join=True``).
        ProcessHungException: A rank stopped sending heartbeats (``join=True``).
        TypeError: ``fn`` is not callable, is a generator function, or cannot
            be pickled for the start method, even by value; ``args`` is not a
            sequence; an ``env`` callable returned no mapping. Raised before any
            process starts.
        ValueError: ``nprocs`` (too many for the process's file limit with
            these options), ``start_method``, ``grace_period`` or an output
            option is invalid; ``env`` has an empty name, a name with ``=`` or a
            NUL, or a value with a NUL; an output directory is a link, not ours,
            or writable by its group or others, or a rank's file there is a link,
            not a regular file of ours, or has other hard links; the devices
            asked for do not fit (``devices_per_rank`` times ``nprocs`` is more
            than ``devices``); ``stdout``/``stderr`` is ``"capture"`` with
            ``join=True`` (nobody could read the lines); ``preload`` is bad.
            Raised before any process starts.
        RuntimeError: With ``preload``: the template could not import a
            module, found threads or CUDA after importing it, or died while
            starting a rank; started ranks have been stopped and reaped.
        Exception: A rank could not be started (for example ``args`` that
            cannot be pickled); the ranks already started have been stopped
            and reaped, and a note names the rank.

    Cancellation:
        Cancelling the call while ranks start or run shuts every started rank
        down (SIGTERM, grace period, SIGKILL) and reaps it before the
        cancellation is re-raised, unchanged. A second cancellation does not
        cut that short. Nothing is left running. With ``preload``, a
        cancellation while the template still imports the preload returns
        at once; the import goes on in the template, for the next start.
    """
    with signals_wake_the_loop():  # a notebook's stop button cancels this call
        ctx = await _start_group(
            fn, args, nprocs, daemon, start_method, options, refuse_capture=join
        )
        if not join:
            return ctx
        await ctx.join()
        return ctx.results


@overload
async def spawn(
    fn: Callable[[int, *Ts], T],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    join: Literal[True] = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> list[T]: ...


@overload
async def spawn(
    fn: Callable[[int, *Ts], T],
    args: tuple[*Ts] = ...,
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> AsyncProcessContext[T]: ...


@overload
async def spawn(
    fn: Callable[[int, *Ts], T],
    args: tuple[*Ts],
    nprocs: int,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> AsyncProcessContext[T]: ...


async def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = "spawn",
    **options: Unpack[GroupOptions],
) -> list[Any] | AsyncProcessContext[Any]:
    """:func:`start_processes` with the ``spawn`` start method, always.

    Another ``start_method`` is ignored with a :class:`FutureWarning` naming
    :func:`start_processes`, as ``torch.multiprocessing.spawn`` does.

    ``spawn(fn, nprocs=n, preload=["torch"])`` is the warm sibling: one
    template is spawned and imports ``torch``, and the ranks are forked from
    it. They keep what ``spawn`` promises (nothing of this process's memory,
    threads or event loop reaches them) and start in milliseconds.

    Args, Returns, Raises and Cancellation: as for :func:`start_processes`.
    """
    if start_method != "spawn":
        warn_spawn_only(start_method, "aiospawn.start_processes")
    return await start_processes(fn, args, nprocs, join, daemon, "spawn", **options)  # type: ignore[call-overload, no-any-return]


def warn_spawn_only(start_method: str | None, instead: str) -> None:
    """Warn, in torch's words, that ``spawn()`` ignores ``start_method``.

    Args:
        start_method: What the caller of ``spawn()`` passed.
        instead: The function to call instead, named in the warning.

    The warning points at the caller of the ``spawn()`` that calls this.
    """
    warnings.warn(
        f"This method only supports start_method=spawn (got: {start_method}).\n"
        "To use a different start_method use:\n\t\t"
        f" {instead}(...)",
        FutureWarning,
        stacklevel=3,
    )


@asynccontextmanager
async def open_group(
    fn: Callable[..., T],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    *,
    start_method: str | None = "spawn",
    daemon: bool = False,
    wait_ready: bool = False,
    **options: Unpack[GroupOptions],
) -> AsyncIterator[AsyncProcessContext[T]]:
    """Start a group and supervise it for the duration of an ``async with`` block.

    ``async with open_group(fn, args, nprocs) as ctx:`` yields the started
    group's :class:`AsyncProcessContext`; the block behaves like a task group
    whose tasks are the ranks:

    * when the block ends normally, the exit waits for every rank, then
      raises the group's failure if a rank failed (``ctx.results`` holds the
      return values otherwise);
    * when the block raises, the ranks are shut down and the block's
      exception propagates;
    * when a rank fails while the block runs, the block is cancelled at once,
      the other ranks are shut down, and the ``async with`` raises the rank's
      :class:`ProcessRaisedException` or :class:`ProcessExitedException`
      itself, not wrapped in an ExceptionGroup;
    * when the block stopped the group itself (``await ctx.terminate()``)
      before any rank failed, the exit raises nothing: ``ctx.results`` holds
      what the ranks that finished returned, and ``None`` for each rank the
      stop ended. (``join()`` of a ``start_processes(join=False)`` context
      after ``terminate()`` raises, as torch's does.)

    Args: as for :func:`start_processes`, and

    * ``wait_ready``: enter the block only once every rank has called
      ``aiospawn.ready()`` (``await ctx.wait_ready()``, bounded by
      ``startup_timeout``); a rank that fails first fails the ``async with``.

    Raises:
        ProcessRaisedException: A rank's ``fn`` raised.
        ProcessExitedException: A rank exited with a non-zero code or was
            killed by a signal.
        TypeError, ValueError: As for :func:`start_processes`, before any
            process starts.
        TimeoutError: With ``wait_ready``, a rank was not ready within
            ``startup_timeout``; the ranks are shut down first.

    Cancellation:
        Cancelling the scope that owns the block shuts the ranks down
        (SIGTERM, grace period, SIGKILL) and reaps them all before the
        cancellation propagates, unchanged. With ``preload``, a cancellation
        while the template still imports returns at once (as for
        :func:`start_processes`).
    """
    with signals_wake_the_loop():  # a notebook's stop button cancels the block
        ctx: AsyncProcessContext[T] = await _start_group(
            fn, args, nprocs, daemon, start_method, options
        )
        async with ctx:
            if wait_ready:
                await ctx.wait_ready()
            yield ctx


async def _start_group(
    fn: Callable[..., Any],
    args: Sequence[Any],
    nprocs: int,
    daemon: bool,
    start_method: str | None,
    options: GroupOptions,
    *,
    refuse_capture: bool = False,
) -> AsyncProcessContext[Any]:
    await import_off_the_loop(CHECKS)
    from ._core._policy import RestartPolicy, Supervision
    from ._core._spec import DEFAULT_PREFIX, check_seconds, make_output_spec, make_spec

    unknown = set(options) - set(GroupOptions.__annotations__)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    supervision = Supervision(
        grace_period=options.get("grace_period"),
        restart=options.get("restart"),
        heartbeat_timeout=options.get("heartbeat_timeout"),
        startup_timeout=options.get("startup_timeout"),
    )
    check_seconds("grace_period", supervision.grace_period)
    check_seconds("heartbeat_timeout", supervision.heartbeat_timeout, positive=True)
    check_seconds("startup_timeout", supervision.startup_timeout, positive=True)
    if supervision.restart is not None and not isinstance(supervision.restart, RestartPolicy):
        raise TypeError(f"restart must be an aiospawn.RestartPolicy, got {supervision.restart!r}")
    output = make_output_spec(
        options.get("stdout", default_stream_mode()),
        options.get("stderr", default_stream_mode()),
        options.get("tee", False),
        options.get("prefix", DEFAULT_PREFIX),
    )
    spec = make_spec(
        fn,
        args,
        nprocs,
        start_method,
        daemon,
        env=options.get("env"),
        output=output,
        torchrun_env=options.get("torchrun_env", False),
        heartbeats=supervision.watches_heartbeats,
        preload=options.get("preload"),
        devices_per_rank=options.get("devices_per_rank"),
        devices=options.get("devices"),
        rank_loop=options.get("rank_loop", "asyncio"),
    )
    from ._local._backend import LocalBackend

    # A backend given is never the local one: LocalBackend is private.
    backend = options.get("backend") or LocalBackend()
    backend.check(spec)
    # Per-rank output options are resolved by now if the check read them; if not, here.
    captures = spec.output.captures
    if refuse_capture and captures:
        # With join=True the caller never holds the context, so nobody could
        # iterate ctx.output(): the lines would pile up unread.
        raise ValueError(
            "stdout or stderr 'capture' keeps lines for ctx.output(), which join=True gives"
            " no way to iterate; use `async with aiospawn.open_group(...) as ctx`, or"
            " start_processes(..., join=False), and iterate ctx.output()"
        )
    if isinstance(backend, LocalBackend):
        # Before the supervisor's modules are imported: a fork server starts up meanwhile.
        await backend.prepare(spec)
    await import_off_the_loop(SUPERVISOR)
    from ._core._context import AsyncProcessContext

    return await AsyncProcessContext._start(spec, supervision, backend)
