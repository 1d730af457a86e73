"""Start methods, argument checks, and concurrent starts of a group's local ranks.

``Process.start()`` can block: under ``spawn`` and ``forkserver`` it writes the
pickled ``fn`` and ``args`` into a 64 KiB pipe and waits until the child has
read them, which happens only after the child has imported ``fn``'s module
(torch issue 133010). So those starts run on worker threads, side by side: N
ranks take about one rank's start time. A ``fork`` start never waits for the
child; those run on the event-loop thread, one at a time, with a checkpoint
between them. Each process object exists before its start, and starts are
never abandoned on cancellation, so no rank can start behind our back.

Under ``spawn`` and ``forkserver``, ``fn`` and ``args`` are pickled by
reference with the process object, as multiprocessing does, unless ``fn`` must
go by value (``_core._spec.needs_value``) or ``__main__`` is interactive (a
notebook, ``python -c``): there the objects defined in ``__main__`` pickle by
name, yet no rank could import them, so ``fn`` and ``args`` are checked as they
are pickled, and go by value (cloudpickle) if any of them needs it. Those
travel as one :class:`~aiospawn._rank.bootstrap.Payload`.

With ``preload``, a rank's process is a :class:`~._template.WarmProcess`
forked by a shared template (``_template``). The group first leases a ready
template: waiting for its import happens on the event loop, cancellable, with
no thread blocked; the forks then run on threads as other starts do (the
template answers at once).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import sys
import threading
import weakref
from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._backend import raise_start_error
from aiospawn._core._capture import CaptureBuffer
from aiospawn._core._env import free_port, rank_environment, torchrun_environment
from aiospawn._core._loops import running_asyncio_loop
from aiospawn._core._spec import LaunchSpec, dumps_payload, interactive_main
from aiospawn._rank.bootstrap import (
    RankSetup,
    early_environment,
    run_rank,
    unpickle_in_rank,
    unpickle_now,
)
from aiospawn._rank.wire import ChildEnd

from . import _pipes
from ._link import SocketLink, rank_socket
from ._output import RankOutput, close_log_dirs, open_log_dirs
from ._pipes import rank_pipe
from ._progress import RankProgress
from ._rank import LocalRank

if TYPE_CHECKING:
    from aiospawn._core._backend import GroupLauncher, RankHandle

#: How many ranks of one group start at the same time. More threads would
#: fight the event loop for the GIL while they pickle and fork: with 32, a
#: 64-rank spawn start stalled the loop for about 200 ms, with 8 about 30 ms.
START_CONCURRENCY = 8


class LocalBackend:
    """Runs a group's ranks as child processes of this one (the default backend)."""

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> GroupLauncher:
        """Return the launcher of the group ``spec``; nothing starts yet.

        Raises:
            ValueError: An output directory cannot be used safely (see
                ``_output.open_log_dir``).
            OSError: An output directory cannot be made or opened.
        """
        return LocalLauncher(spec, capture)


class LocalLauncher:
    """Makes and starts the local ranks of one group (see ``_backend.GroupLauncher``)."""

    def __init__(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> None:
        # (A forkserver group's server was started, with the bootstrap
        # preloaded, before the group came here: _forkserver.start_early.)
        self._spec = spec
        self._capture = capture
        self._master_port: int | None = None
        self._fresh_port = True
        self._log_dirs = open_log_dirs(spec.output)

    def make_rank(self, index: int, restart: int) -> LocalRank:
        """Create (without starting) attempt number ``restart`` of rank ``index``.

        Raises:
            ValueError: The environment is unusable, or a log file cannot be
                used safely.
            OSError: A pipe or file cannot be made. Whatever was opened for
                the rank is closed again.
        """
        spec = self._spec
        # typeshed gives get_context(str) the BaseContext type, which lacks Process.
        context: Any = multiprocessing.get_context(spec.start_method)
        env = self._environment(index, restart)  # first: it runs the user's env callable
        reader, writer = rank_pipe()
        output: RankOutput | None = None
        link: tuple[int, ChildEnd] | None = None
        try:
            link = rank_socket()
            output = RankOutput(
                spec.output, index, self._capture, restart=restart, log_dirs=self._log_dirs
            )
            progress = RankProgress() if spec.heartbeats else None
        except BaseException:
            if output is not None:
                output.discard()
            for fd in (reader, writer.fd, *((link[0], link[1].fd) if link else ())):
                _pipes.close(fd)
            raise
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
            # A warm rank ends as a forkserver rank does (os._exit after the exit steps).
            start_method="forkserver" if warm else spec.start_method,
            # The live table: a fork copies it as it is at that moment.
            inherited=_fork_table() if spec.start_method == "fork" and not warm else None,
            channel=link[1],
            loop=spec.rank_loop,
        )
        name = f"aiospawn-rank-{index}"
        process: Any
        if warm:
            # By value as for a spawn rank when fn needs it (run_rank unpacks it).
            by_value = spec.fn_by_value or interactive_main()
            fn: Any = _SendPayload(spec) if by_value else spec.fn
            args = () if by_value else spec.args
            # Imported here: a group without preload= never needs it.
            from ._template import WarmProcess

            process = WarmProcess(
                spec.preload, fn, index, args, writer, setup, name=name, daemon=spec.daemon
            )
        else:
            if spec.start_method != "fork":
                name = early_environment(name, setup.env, _unloadable_main_path())
            if spec.start_method == "fork" or not (spec.fn_by_value or interactive_main()):
                # As multiprocessing sends them: inherited by a fork rank, else
                # pickled inline with the process object, at no extra cost.
                work: tuple[Any, ...] = (spec.fn, index, spec.args, writer, setup)
            else:
                work = (_SendPayload(spec), index, (), writer, setup)
            process = context.Process(target=run_rank, args=work, daemon=spec.daemon, name=name)
        return LocalRank(
            index,
            process,
            reader,
            writer,
            output,
            # Both get the exit status from the rank's parent, not from waitpid().
            exit_via_sentinel=spec.start_method == "forkserver" or warm,
            progress=progress,
            link=SocketLink(link[0]),
            link_end=link[1],
        )

    async def start(self, ranks: Sequence[RankHandle]) -> None:
        """Start ``ranks``, made by :meth:`make_rank`, side by side (see :func:`start_ranks`)."""
        local = [rank for rank in ranks if isinstance(rank, LocalRank)]
        assert len(local) == len(ranks), "a local launcher starts the ranks it made"
        if not self._spec.preload:
            await start_ranks(local, self._spec.start_method)
            return
        from ._template import WarmProcess, acquire, release

        try:
            template = await acquire(self._spec.preload)
        except BaseException as exc:
            for rank in local:
                rank.discard()
            if isinstance(exc, Exception) and local:
                raise_start_error({min(rank.rank for rank in local): exc}, len(local))
            raise
        try:
            for rank in local:
                assert isinstance(rank.process, WarmProcess)
                rank.process.template = template
            await start_ranks(local, "warm")
        finally:
            release(template)  # each rank forked holds it on its own

    def new_rendezvous(self) -> None:
        """Pick a fresh ``MASTER_PORT``, not the last one, for the next ranks made."""
        self._fresh_port = True

    async def aclose(self) -> None:
        """Close the log directories; each rank releases its own descriptors when reaped."""
        close_log_dirs(self._log_dirs)

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


class _SendPayload:
    """Pickles into the rank's :class:`~aiospawn._rank.bootstrap.Payload`.

    Pickled once per rank, as multiprocessing pickled ``fn`` and ``args``
    before, and on the thread that starts the rank; an error is raised
    from ``Process.start()`` unchanged.
    """

    def __init__(self, spec: LaunchSpec) -> None:
        self._spec = spec

    def __reduce__(self) -> tuple[Any, ...]:
        spec = self._spec
        by_value, data = dumps_payload(spec.fn, spec.args, by_value=spec.fn_by_value)
        return (unpickle_in_rank if by_value else unpickle_now), (data,)


def _unloadable_main_path() -> str | None:
    """The path a ``spawn`` rank would run ``__main__`` from, if that is not a file.

    The same path as multiprocessing's preparation data gives the rank
    (``spawn.get_preparation_data``): ``__file__``, made absolute from the
    directory the program started in.
    """
    main = sys.modules.get("__main__")
    path: str | None = getattr(main, "__file__", None)
    if path is None or not interactive_main():
        return None
    original_dir = multiprocessing.process.ORIGINAL_DIR  # type: ignore[attr-defined]
    if not os.path.isabs(path) and original_dir is not None:
        path = os.path.join(original_dir, path)
    return os.path.normpath(path)


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
    raise_start_error(errors, len(ranks))


#: The wakeup sockets of every event loop that has made a fork rank (see _fork_table).
_wakeup_sockets: weakref.WeakSet[Any] = weakref.WeakSet()
#: Loops in other threads make fork ranks too.
_wakeup_lock = threading.Lock()


def _fork_table() -> Mapping[int, tuple[int, int]]:
    """The supervisor descriptors a fork rank drops: the live table, and the loops' wakeup sockets.

    The table is live: the fork copies it as it is at that moment, with the
    descriptors of the ranks started before this one.

    A fork rank used to find the event loop's wakeup fd by asking
    ``signal.set_wakeup_fd``; since Python 3.12 asyncio resets it to -1 in
    every forked child (``asyncio.events.on_fork``) and leaves the socket
    open, whichever loop set it. So the supervisor names the wakeup sockets
    itself, from the loops' own attributes (read with ``getattr``: the
    architecture page lists them), and the rank drops them by file identity
    like any other descriptor of ours. Those of the running loop (two loops
    under trio's guest mode), and of every other loop that made a fork rank
    while it is open (a loop in another thread): the socket objects are held
    weakly and read at each fork, so a loop that closed its sockets (their
    ``fileno()`` is -1 then) or is gone leaves no stale number behind.
    """
    with _wakeup_lock:
        _wakeup_sockets.update(_loop_wakeup_sockets())
        sockets = {}
        for sock in list(_wakeup_sockets):
            try:
                info = os.fstat(sock.fileno())
            except OSError:  # closed by its loop: fileno() is -1
                continue
            sockets[sock.fileno()] = (info.st_dev, info.st_ino)
    return ChainMap(_pipes.held(), sockets)


def _loop_wakeup_sockets() -> list[Any]:
    """The wakeup sockets of this thread's running loops: trio's, asyncio's, or both."""
    found = []
    trio = sys.modules.get("trio")
    runner = getattr(
        getattr(getattr(trio, "_core", None), "_run", None), "GLOBAL_RUN_CONTEXT", None
    )
    wakeup = getattr(getattr(getattr(runner, "runner", None), "entry_queue", None), "wakeup", None)
    if wakeup is not None:  # trio's WakeupSocketpair
        found += [wakeup.wakeup_sock, wakeup.write_sock]
    loop = running_asyncio_loop()
    # The selector loop's self-pipe, whose write end is its signal wakeup fd;
    # a trio run in guest mode has its asyncio host's too.
    found += [getattr(loop, "_ssock", None), getattr(loop, "_csock", None)]
    return [sock for sock in found if sock is not None and sock.fileno() >= 0]
