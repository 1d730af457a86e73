"""The local backend: its refusals, written once, and its launcher, made when a group opens.

Light on purpose: the entry points import it, check the group and let its
start method prepare (:meth:`LocalBackend.prepare`) before they import the
supervisor's modules; the launcher's modules come with :meth:`LocalBackend.open`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._limits import Devices, assign_devices, check_capacity, fds_per_rank
from ._strategy import Strategy, choose

if TYPE_CHECKING:
    from aiospawn._core._capture import CaptureBuffer
    from aiospawn._core._spec import LaunchSpec

    from ._launcher import LocalLauncher


class LocalBackend:
    """Runs a group's ranks as child processes of this one (the default backend).

    One per group: what its check decides (the start strategy, each rank's
    devices) is what the group's launcher uses.
    """

    def __init__(self) -> None:
        self._checked: tuple[LaunchSpec, Strategy, Devices] | None = None

    def check(self, spec: LaunchSpec) -> None:
        """Refuse, before anything starts, what local processes cannot run.

        Raises:
            ValueError: ``start_method`` is unknown or not available on this
                platform, or is ``"fork"`` with ``preload``; this process
                cannot hold ``nprocs`` ranks with these options (its
                ``RLIMIT_NOFILE`` and ``RLIMIT_NPROC``); a per-rank output
                option is bad for some rank; the devices asked for do not fit
                (see ``_limits.assign_devices``).
            TypeError: ``fn`` cannot reach a rank that receives it pickled,
                even by value.
        """
        self._check(spec)

    async def prepare(self, spec: LaunchSpec) -> None:
        """Start what the group's first rank needs and may start early (a fork server).

        Raises:
            OSError: What was started early could not be.
        """
        strategy, _ = self._check(spec)
        await strategy.prepare()

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> LocalLauncher:
        """Return the launcher of the group ``spec``, checked if it was not; nothing starts yet.

        Raises:
            ValueError, TypeError: As :meth:`check`.
            ValueError: An output directory cannot be used safely (see
                ``_output.open_log_dir``).
            OSError: An output directory cannot be made or opened.
        """
        strategy, devices = self._check(spec)
        from ._launcher import LocalLauncher

        return LocalLauncher(spec, strategy, devices, capture)

    def _check(self, spec: LaunchSpec) -> tuple[Strategy, Devices]:
        checked = self._checked
        if checked is None or checked[0] is not spec:
            strategy = choose(spec)
            # First a bound that reads no per-rank option: with a huge nprocs,
            # the user's per-rank callables would run for every rank first.
            check_capacity(spec.nprocs)
            check_capacity(spec.nprocs, fds_per_rank(spec.output, spec.heartbeats))
            devices = assign_devices(spec.nprocs, spec.devices_per_rank, spec.devices)
            strategy.check()
            checked = self._checked = (spec, strategy, devices)
        return checked[1], checked[2]
