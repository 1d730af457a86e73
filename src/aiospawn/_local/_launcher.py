"""Making and starting a group's local ranks, whatever their start method.

A :class:`LocalLauncher` makes each rank attempt the same way: its
environment, result pipe, channel, output plumbing and heartbeat slot, and the
:class:`~aiospawn._rank.bootstrap.RankSetup` that tells the rank its
surroundings. What differs between start methods (the process object, what
the rank inherits, how its exit is read, how ranks are started) is the
group's :class:`~._strategy.Strategy`, chosen once when the group was checked
(``_backend.LocalBackend``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiospawn._core._capture import CaptureBuffer
from aiospawn._core._env import free_port, rank_environment, torchrun_environment
from aiospawn._core._spec import LaunchSpec
from aiospawn._rank.bootstrap import RankSetup
from aiospawn._rank.wire import ChildEnd

from . import _pipes
from ._link import SocketLink, rank_socket
from ._output import RankOutput, close_log_dirs, open_log_dirs
from ._pipes import rank_pipe
from ._progress import RankProgress
from ._rank import LocalRank

if TYPE_CHECKING:
    from aiospawn._core._backend import RankHandle

    from ._limits import Devices
    from ._strategy import Strategy


class LocalLauncher:
    """Makes and starts the local ranks of one group (see ``_backend.GroupLauncher``)."""

    def __init__(
        self,
        spec: LaunchSpec,
        strategy: Strategy,
        devices: Devices,
        capture: CaptureBuffer | None,
    ) -> None:
        self._spec = spec
        self._strategy = strategy
        self._devices = devices
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
        strategy = self._strategy
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
        setup = RankSetup(
            supervisor_pid=os.getpid(),
            supervisor_is_parent=strategy.supervisor_is_parent,
            env=env,
            stdout=output.targets["stdout"],
            stderr=output.targets["stderr"],
            restart=restart,
            heartbeat=progress.child_ends[0] if progress else None,
            stacks=progress.child_ends[1] if progress else None,
            start_method=strategy.name,
            inherited=strategy.inherited(),
            channel=link[1],
            loop=spec.rank_loop,
        )
        return LocalRank(
            index,
            strategy.process(index, writer, setup, f"aiospawn-rank-{index}"),
            reader,
            writer,
            output,
            exit_via_sentinel=strategy.exit_via_sentinel,
            progress=progress,
            link=SocketLink(link[0]),
            link_end=link[1],
        )

    async def start(self, ranks: Sequence[RankHandle]) -> None:
        """Start ``ranks``, made by :meth:`make_rank`, as the group's strategy does."""
        local = [rank for rank in ranks if isinstance(rank, LocalRank)]
        assert len(local) == len(ranks), "a local launcher starts the ranks it made"
        await self._strategy.start(local)

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
        devices = None if self._devices is None else self._devices[index]
        return rank_environment(spec, index, restart, torchrun, devices)
