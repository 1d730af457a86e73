"""A rank's environment on any backend: the restart count, torchrun's variables, the user's.

:func:`rank_environment` builds it. torchrun's variables are for code written
for torchrun:
``torch.distributed``'s ``env://`` initialisation reads ``MASTER_ADDR`` and
``MASTER_PORT`` (rank 0 listens there) plus ``RANK`` and ``WORLD_SIZE``;
torchrun also sets the local and role sizes and its restart bookkeeping.
A single-machine group is one torchrun "node": ``GROUP_RANK`` 0 of 1.
``TORCHELASTIC_USE_AGENT_STORE`` stays unset: there is no agent store, so
rank 0 hosts the store itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from aiospawn._rank.wire import RESTART_COUNT_VAR

from ._spec import check_environment

if TYPE_CHECKING:
    from ._spec import LaunchSpec


def free_port(host: str = "127.0.0.1", *, avoid: int | None = None) -> int:
    """A TCP port on ``host`` that nothing uses at the time of the call, other than ``avoid``."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port != avoid:
            return port


def torchrun_environment(
    rank: int,
    world_size: int,
    restart: int,
    master_port: int,
    *,
    master_addr: str = "127.0.0.1",
    local_rank: int | None = None,
    local_world_size: int | None = None,
    group_rank: int = 0,
    group_world_size: int = 1,
) -> dict[str, str]:
    """The variables torchrun sets in worker ``rank`` (local values default to global)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
    }


#: Where the NVIDIA driver lists the GPUs of this machine, one entry each.
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_devices(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` names them.

    That variable when it is set (``""``: none); otherwise ``0..n-1`` for the
    ``n`` GPUs the NVIDIA driver lists, which reading needs no CUDA library.
    """
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [device.strip() for device in value.split(",") if device.strip()]
    try:
        count = len(os.listdir(NVIDIA_GPUS))
    except OSError:  # no driver: no GPU
        count = 0
    return [str(index) for index in range(count)]


def rank_environment(
    spec: LaunchSpec,
    index: int,
    restart: int,
    torchrun: Mapping[str, str] | None,
    devices: Sequence[str] | None = None,
) -> dict[str, str]:
    """The environment of attempt ``restart`` of rank ``index``, on any backend.

    The restart count, then torchrun's variables if the group asked for them,
    then ``CUDA_VISIBLE_DEVICES`` if the backend gave the rank ``devices`` of
    its own, then the user's ``env``, which wins.

    Raises:
        TypeError: An ``env`` callable returned something other than a mapping.
        ValueError: What it returned cannot be an environment (see
            ``_spec.check_environment``).
    """
    env = {RESTART_COUNT_VAR: str(restart), **(torchrun or {})}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    user = spec.env(index) if callable(spec.env) else spec.env
    if callable(spec.env):
        if not isinstance(user, Mapping):
            raise TypeError(f"env({index}) must return a mapping, got {user!r}")
        check_environment(user, f"env({index})")
    if user:
        env.update({str(key): str(value) for key, value in user.items()})
    return env
