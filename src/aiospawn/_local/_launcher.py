"""Start methods, argument checks, and concurrent starts of a group's local ranks.

``Process.start()`` can block: under ``spawn`` and ``forkserver`` it writes the
pickled ``fn`` and ``args`` into a 64 KiB pipe and waits until the child has
read them, which happens only after the child has imported ``fn``'s module
(torch issue 133010). So those starts run on worker threads, side by side: N
ranks take about one rank's start time. A ``fork`` start never waits for the
child; those run on the event-loop thread, one at a time, with a checkpoint
between them. Each process object exists before its start, and starts are
never abandoned on cancellation, so no rank can start behind our back.

With ``preload``, a rank's process is a :class:`~._template.WarmProcess`
forked by a shared template (``_template``); its start blocks too (the
template may have to import the preload first), so it runs on a thread.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._backend import OnExit
from aiospawn._core._capture import CaptureBuffer
from aiospawn._core._env import free_port, rank_environment, torchrun_environment
from aiospawn._core._spec import LaunchSpec
from aiospawn._rank.bootstrap import RankSetup, early_environment, run_rank

from ._output import RankOutput
from ._pipes import rank_pipe
from ._progress import RankProgress
from ._rank import LocalRank
from ._template import WarmProcess

if TYPE_CHECKING:
    from aiospawn._core._backend import GroupLauncher, RankHandle

#: How many ranks of one group start at the same time. More threads would
#: fight the event loop for the GIL while they pickle and fork: with 32, a
#: 64-rank spawn start stalled the loop for about 200 ms, with 8 about 30 ms.
START_CONCURRENCY = 8


class LocalBackend:
    """Runs a group's ranks as child processes of this one (the default backend)."""

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> GroupLauncher:
        """Return the launcher of the group ``spec``; nothing starts yet."""
        return LocalLauncher(spec, capture)


class LocalLauncher:
    """Makes and starts the local ranks of one group (see ``_backend.GroupLauncher``)."""

    def __init__(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> None:
        if spec.start_method == "forkserver" and not spec.preload:
            preload_bootstrap_in_forkserver()
        self._spec = spec
        self._capture = capture
        self._master_port: int | None = None
        self._fresh_port = True

    def make_rank(self, index: int, restart: int, on_exit: OnExit) -> LocalRank:
        """Create (without starting) attempt number ``restart`` of rank ``index``."""
        spec = self._spec
        # typeshed gives get_context(str) the BaseContext type, which lacks Process.
        context: Any = multiprocessing.get_context(spec.start_method)
        env = self._environment(index, restart)  # first: it runs the user's env callable
        reader, writer = rank_pipe()
        output = RankOutput(spec.output, index, self._capture, restart=restart)
        progress = RankProgress() if spec.heartbeats else None
        warm = bool(spec.preload)
        setup = RankSetup(
            supervisor_pid=os.getpid(),
            # A warm rank's parent is its template, a forkserver rank's the server.
            supervisor_is_parent=spec.start_method != "forkserver" and not warm,
            env=env,
            stdout=output.targets["stdout"],
            stderr=output.targets["stderr"],
            restart=restart,
            heartbeat=progress.child_ends[0] if progress else None,
            stacks=progress.child_ends[1] if progress else None,
        )
        process: Any
        if warm:
            process = WarmProcess(
                spec.preload,
                spec.fn,
                index,
                spec.args,
                writer,
                setup,
                name=f"aiospawn-rank-{index}",
                daemon=spec.daemon,
            )
        else:
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
            # Both get the exit status from the rank's parent, not from waitpid().
            exit_via_sentinel=spec.start_method == "forkserver" or warm,
            on_exit=on_exit,
            progress=progress,
        )

    async def start(self, ranks: Sequence[RankHandle]) -> None:
        """Start ``ranks``, made by :meth:`make_rank`, side by side (see :func:`start_ranks`)."""
        local = [rank for rank in ranks if isinstance(rank, LocalRank)]
        assert len(local) == len(ranks), "a local launcher starts the ranks it made"
        await start_ranks(local, "warm" if self._spec.preload else self._spec.start_method)

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


#: The module every forkserver rank would otherwise import for itself.
_BOOTSTRAP = "aiospawn._rank.bootstrap"


def preload_bootstrap_in_forkserver() -> None:
    """Have the fork server, when it starts, import the rank bootstrap once for all ranks.

    Each forkserver rank otherwise imports it (and ``typing``) for itself:
    8 trivial ranks took 126 ms rather than 69 ms here. The user's own preload
    list is kept, and nothing changes once the server runs. The list lives in
    a private attribute (stable since Python 3.4); without it, nothing is done.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    modules = getattr(server, "_preload_modules", None)
    if isinstance(modules, list) and _BOOTSTRAP not in modules:
        multiprocessing.forkserver.set_forkserver_preload([*modules, _BOOTSTRAP])


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
