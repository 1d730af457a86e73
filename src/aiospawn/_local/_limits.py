"""What this machine gives a group of local ranks: descriptors, processes, devices.

The supervisor holds descriptors for each rank (:func:`fds_per_rank`) and each
rank is a process of this user, so a group fits within ``RLIMIT_NOFILE`` and
``RLIMIT_NPROC`` (:func:`max_nprocs`, :func:`check_capacity`); each rank may
get devices of its own from those this process sees (:func:`assign_devices`).

Light on purpose: the group's check imports it before the supervisor's modules.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence

from aiospawn._core._spec import OutputSpec, check_devices_per_rank

#: Each rank's own devices, index = rank; None: the ranks see what this process sees.
Devices = tuple[tuple[str, ...], ...] | None

#: Descriptors the supervisor holds for a rank whatever its options: the two
#: ends of its result pipe and of its channel's socket pair until it starts,
#: then the result pipe's read end, our end of the channel, the two ends of
#: ``multiprocessing``'s sentinel pipe and a pidfd.
FDS_PER_RANK = 6

#: What each stream mode adds: a pipe (both ends until the rank starts); a
#: directory adds the file, and with ``tee`` a pipe too.
_STREAM_FDS = {"inherit": 0, "devnull": 0, "prefix": 2, "capture": 2}

#: What heartbeats add: the memory file, the duplicate its mapping holds, and
#: the stack pipe's two ends.
_HEARTBEAT_FDS = 4

#: What a group's shared-memory pool may hold open: two per segment, at most
#: ``_core._pool.MAX_SEGMENTS`` segments (not imported: this module is light).
POOL_FDS = 64

#: Kept for everything else the process holds, for starts under way
#: (``multiprocessing`` opens a few descriptors while it starts a process), and
#: for the pool.
_RESERVED_FDS = 64 + 32 + POOL_FDS


def fds_per_rank(output: OutputSpec | None = None, heartbeats: bool = False) -> int:
    """The most descriptors the supervisor holds for one rank with these options.

    ``output`` has its per-rank options resolved (``OutputSpec.for_group``).
    """
    count = FDS_PER_RANK + (_HEARTBEAT_FDS if heartbeats else 0)
    if output is None:
        return count
    # The busiest rank counts: with per-rank modes the ranks differ.
    ranks = output.ranks or (output.for_rank(0),)
    return count + max(
        sum(
            _STREAM_FDS[mode] if isinstance(mode, str) else (3 if name in teed else 1)
            for name, mode in modes.items()
        )
        for modes, teed in ranks
    )


def max_nprocs(output: OutputSpec | None = None, heartbeats: bool = False) -> int:
    """The largest group this process can hold, from its process and file limits.

    Each rank needs one process (``RLIMIT_NPROC``) and :func:`fds_per_rank`
    descriptors here (``RLIMIT_NOFILE``, less a reserve for everything else).
    """
    return _limit(fds_per_rank(output, heartbeats))


def _limit(fds: int) -> int:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    limits = [
        (nofile - _RESERVED_FDS) // fds if nofile != resource.RLIM_INFINITY else sys.maxsize,
        nproc if nproc != resource.RLIM_INFINITY else sys.maxsize,
    ]
    return max(1, min(limits))


def check_capacity(nprocs: int, fds: int = FDS_PER_RANK) -> None:
    """Raise ValueError if this process cannot hold ``nprocs`` ranks of ``fds`` descriptors each.

    ``fds`` is what one rank needs (:func:`fds_per_rank`); the default, the
    fewest a rank can take, is a bound that needs no per-rank option read.
    """
    limit = _limit(fds)
    if nprocs > limit:
        raise ValueError(
            f"nprocs={nprocs} is more than this process can supervise ({limit}, from"
            f" RLIMIT_NOFILE and RLIMIT_NPROC, at {fds} descriptors per rank with these"
            " output and heartbeat options); raise the limits (ulimit -n, ulimit -u)"
            " or start fewer ranks"
        )


def assign_devices(
    nprocs: int, per_rank: int | None, devices: Sequence[int | str] | None
) -> Devices:
    """Give each rank its own devices: rank ``r`` the ``r``-th run of ``per_rank`` of them.

    ``devices`` is the pool, by default the devices visible here (see
    :func:`~aiospawn._core._env.visible_devices`); without ``per_rank`` the pool
    is split evenly. ``None`` when neither is given: the ranks see what we see.

    Raises:
        ValueError: ``per_rank`` is not a non-negative int; the pool has fewer
            than ``nprocs * per_rank`` devices, or does not split evenly over
            the ranks, or names a device twice.
    """
    check_devices_per_rank(per_rank)
    if per_rank is None and devices is None:
        return None
    if devices is None:
        from aiospawn._core._env import visible_devices

        pool, where = visible_devices(), "visible (CUDA_VISIBLE_DEVICES, or the NVIDIA driver)"
    else:
        if isinstance(devices, str | bytes) or not isinstance(devices, Sequence):
            raise ValueError(f"devices must be a sequence of device ids, got {devices!r}")
        pool, where = [str(device).strip() for device in devices], "given"
        if any(not device or "," in device for device in pool):
            raise ValueError(f"devices must be device ids such as 0 or 'GPU-...', got {devices!r}")
        if len(set(pool)) != len(pool):
            raise ValueError(f"devices names a device twice: {devices!r}")
    if per_rank is None:
        per_rank, left = divmod(len(pool), nprocs)
        if per_rank == 0 or left:
            raise ValueError(
                f"{len(pool)} devices do not split evenly over {nprocs} ranks ({pool!r});"
                " say how many each rank gets with devices_per_rank"
            )
    needed = nprocs * per_rank
    if needed > len(pool):
        raise ValueError(
            f"{nprocs} ranks of {per_rank} device{'s' if per_rank != 1 else ''} each need"
            f" {needed}, but {len(pool)} {'is' if len(pool) == 1 else 'are'} {where}"
            f" ({','.join(pool) or 'none'}); start fewer ranks, give each fewer devices,"
            " or name the devices to use"
        )
    return tuple(tuple(pool[rank * per_rank : (rank + 1) * per_rank]) for rank in range(nprocs))
