"""Run a group's ranks on a Ray cluster: the same groups across machines.

Pass ``backend=aiospawn.ray.RayBackend(...)`` to ``start_processes``,
``spawn`` or ``open_group``; everything else (``join``, ``terminate``,
``async with``, the exceptions, restarts) behaves as with local processes.
Each rank runs ``fn(rank, *args)`` in a Ray actor of its own, on the main
thread of the actor's worker process. What Ray itself lacks is added here:

* **gang start**: every rank's resources are reserved at once (a placement
  group with one bundle per rank) before any rank runs;
* **fail-fast**: the first failing rank stops every other one (SIGTERM
  delivered to the rank's own process, the grace period, then ``ray.kill``),
  and the placement group is released;
* **cancellation** of the owning task does the same before it propagates;
* **exact errors**: ``ProcessRaisedException`` with the rank's own exception
  as ``__cause__`` (not Ray's wrapper), ``ProcessExitedException`` when a
  rank's worker process or its node dies, with Ray's account of it and the
  node's address as a note;
* **torchrun's environment** (with ``torchrun_env=True``): ``MASTER_ADDR`` is
  rank 0's node, ``MASTER_PORT`` a free port there, and ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` follow the placement.

Not available across machines: ``stdout``/``stderr`` modes other than
``"inherit"`` (Ray forwards each worker's output to the driver itself) and
``heartbeat_timeout`` (heartbeats and stacks stay on one machine); asking for
them raises ``ValueError`` before anything is reserved.

``import aiospawn.ray`` works without Ray installed; constructing a
:class:`RayBackend` raises ``ImportError`` naming the extra to install
(``pip install "aiospawn[ray]"``).

Layout and import rule: this public package holds private modules,
``_launcher`` (the group's launcher: placement, actors, a board per node),
``_rank`` (one rank attempt's handle), ``_actor``, ``_board`` and
``_connection`` (what runs on the cluster: a rank's actor, the board on each
node, and the board's end of each rank's channel), ``_link`` and ``_relay``
(a rank's channel, through the board on its node), ``_bridge`` (Ray futures
to the event loop). They may import
the standard library, anyio, ray (lazily: never at import time),
``aiospawn._core`` and ``aiospawn._rank``; never ``aiospawn._local``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from aiospawn._core._capture import CaptureBuffer
from aiospawn._core._spec import LaunchSpec, check_seconds

if TYPE_CHECKING:
    from ._launcher import RayLauncher

__all__ = ["PLACEMENT_STRATEGIES", "RayBackend"]

#: The placement strategies Ray offers for a group's bundles.
PLACEMENT_STRATEGIES: Final = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, slots=True, kw_only=True)
class RayBackend:
    """Run each rank as a Ray actor on an existing Ray cluster.

    Args:
        address: The cluster to connect to, as ``ray.init(address=...)`` takes
            it: ``"auto"`` (a cluster started on this machine with
            ``ray start``, or the ``RAY_ADDRESS`` variable), ``"host:6379"``,
            or ``"ray://host:10001"``. Ignored when this process is already
            connected (``ray.is_initialized()``). A cluster is never started:
            with none there, opening a group raises ``ConnectionError`` saying
            how to start one.
        resources_per_rank: What each rank reserves, in Ray's resource names:
            ``{"CPU": 1}``, ``{"CPU": 4, "GPU": 1}``, custom resources.
        placement: How the ranks' bundles are spread over nodes:
            ``"PACK"`` (as few nodes as possible), ``"SPREAD"``,
            ``"STRICT_PACK"`` (one node) or ``"STRICT_SPREAD"`` (one rank per node).
        runtime_env: Ray's runtime environment for the ranks' actors
            (``{"pip": [...], "working_dir": ...}``), or None for the cluster's own.
        placement_timeout: Seconds to wait for the whole group to be placed; past
            it, nothing is reserved any more and ``TimeoutError`` is raised.

    Raises:
        ImportError: Ray is not installed.
        ValueError: An argument is out of range.
    """

    address: str = "auto"
    resources_per_rank: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    placement: str = "PACK"
    runtime_env: Mapping[str, Any] | None = None
    placement_timeout: float = 60.0

    def __post_init__(self) -> None:
        _require_ray()
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(
                f"address must be a non-empty str such as 'auto', got {self.address!r}"
            )
        if self.placement not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement must be one of {', '.join(map(repr, PLACEMENT_STRATEGIES))},"
                f" got {self.placement!r}"
            )
        resources = self.resources_per_rank
        if (
            not isinstance(resources, Mapping)
            or not resources
            or not all(isinstance(key, str) for key in resources)
            or not all(_is_amount(value) for value in resources.values())
            or not any(value > 0 for value in resources.values())
        ):
            raise ValueError(
                "resources_per_rank must map Ray resource names to non-negative numbers,"
                f" at least one of them positive, such as {{'CPU': 1}}; got {resources!r}"
            )
        # Finite: a group that cannot be placed would wait forever.
        check_seconds(
            "placement_timeout",
            self.placement_timeout,
            allow_none=False,
            positive=True,
            finite=True,
        )

    def check(self, spec: LaunchSpec) -> None:
        """Refuse, before anything is reserved, what this backend cannot run.

        What :func:`check_group` refuses, and a ``devices_per_rank`` that
        disagrees with the ``"GPU"`` of ``resources_per_rank``.

        Raises:
            ValueError: As :func:`check_group`, or the GPUs disagree.
        """
        from ._launcher import rank_resources

        check_group(spec)
        rank_resources(spec, self.resources_per_rank)

    async def open(self, spec: LaunchSpec, capture: CaptureBuffer | None) -> RayLauncher:
        """Connect to the cluster and reserve the group's resources; nothing runs yet.

        Args:
            spec: The group, checked by :meth:`check` (again here: a launcher
                is never made for a group this backend cannot run).
            capture: None: Ray forwards the ranks' output itself.

        Returns:
            The group's launcher, holding its placement group.

        Raises:
            ValueError: As :meth:`check`.
            ConnectionError: No Ray cluster at ``address``.
            TimeoutError: The group could not be placed within ``placement_timeout``.

        Cancellation:
            Whatever was reserved is released before the cancellation propagates.
        """
        from ._launcher import RayLauncher

        self.check(spec)
        return await RayLauncher.open(spec, self)


def check_group(spec: LaunchSpec) -> None:
    """Refuse what no Ray cluster runs for aiospawn, whatever the backend's options.

    Needs no Ray: ``aiospawn run --ray`` refuses its command line with it
    before anything starts.

    Raises:
        ValueError: ``spec`` asks for a warm start (``preload``) or for this
            machine's ``devices``, which stay on one machine; for output other
            than ``"inherit"``, which Ray forwards itself; or for heartbeats,
            which do not cross machines.
    """
    if spec.preload:
        raise ValueError(
            "preload= warm-starts local ranks from a template; RayBackend has no templates"
        )
    if spec.devices is not None:
        raise ValueError(
            f"devices={spec.devices!r} names devices of this machine; with RayBackend ask for"
            " devices_per_rank=N instead, and each rank gets N GPUs of its node"
        )
    output = spec.output
    for stream, mode in (
        item for rank in range(spec.nprocs) for item in output.for_rank(rank)[0].items()
    ):
        if mode != "inherit":
            # capture, and tee (which needs a directory), are refused here too.
            raise ValueError(
                f"RayBackend runs ranks with {stream}='inherit' only, got {mode!r}: Ray forwards"
                " each worker's output to the driver itself (prefixed with the actor's name"
                " and node); set log_to_driver in ray.init() to change that"
            )
    if spec.heartbeats:
        raise ValueError(
            "heartbeat_timeout and startup_timeout are not available with RayBackend:"
            " heartbeats do not cross machines; use a timeout in the ranks' own code"
        )


def _is_amount(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value >= 0


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise ImportError('aiospawn.ray.RayBackend needs Ray: pip install "aiospawn[ray]"') from exc
