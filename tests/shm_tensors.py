"""Torch tensors through memfds, from a supervisor process of its own (``test_shared_memory``).

``python -m tests.shm_tensors`` sends CPU tensors of several dtypes and
layouts to a rank and back, through a channel and a call, and checks that
each comes back with its dtype, shape, strides and ``requires_grad``, mapped
when it is large, and writable as a private copy; then that a tensor the
rank holds stays as it came while later ones reuse the group's segments. Run in a process of its
own: importing torch changes the process (its loggers, ``aiospawn.sync``'s
error classes) for whatever runs after it.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio

import aiospawn
from tests import shm_ranks

MiB = 1 << 20


def tensors(torch: Any) -> dict[str, tuple[Any, bool]]:
    """``name: (tensor, whether its bytes are shared)``."""
    grid = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)
    return {
        "float32, 4 MiB": (grid, True),
        "bfloat16": (torch.ones(MiB, dtype=torch.bfloat16), True),
        "int64, small": (torch.arange(100), False),
        "bool": (torch.ones(2 * MiB, dtype=torch.bool), True),
        "transposed": (grid.t(), True),
        "every other column": (grid[:, ::2], True),
        "a view at an offset": (grid[512:], True),
        "0-d": (torch.tensor(2.5), False),
        "empty": (torch.empty(0, 3), False),
        "requires grad": (torch.ones(MiB // 4, requires_grad=True), True),
        "Parameter (torch's own pickling)": (torch.nn.Parameter(torch.ones(8)), False),
    }


def same_tensor(torch: Any, got: Any, want: Any) -> bool:
    return bool(
        type(got) is type(want)
        and got.dtype == want.dtype
        and got.shape == want.shape
        and got.stride() == want.stride()
        and got.requires_grad == want.requires_grad
        and torch.equal(got.detach(), want.detach())
    )


async def main() -> None:
    import torch

    with anyio.fail_after(240):
        async with aiospawn.open_group(shm_ranks.echo, nprocs=1, start_method="fork") as ctx:
            channel = ctx.channel(0)
            for name, (tensor, shared) in tensors(torch).items():
                await channel.send(tensor)
                maps_there, back = await channel.receive()
                assert maps_there == int(shared), f"{name}: the rank mapped {maps_there}"
                assert len(shm_ranks.memfd_maps()) == int(shared), name
                assert same_tensor(torch, back, tensor), name
                del back
            await channel.send("serve")
            tensor = torch.zeros(MiB)
            [(maps_there, back)] = await ctx.call("echo", tensor)
            assert maps_there == 1
            assert same_tensor(torch, back, tensor)
            back[0] = 5.0  # writable, and a private copy
            assert tensor[0] == 0.0
            del back
        await reused_segments_keep_their_values(torch)
    gc.collect()
    assert shm_ranks.memfd_maps() == []
    print("every tensor came back as it left")


async def reused_segments_keep_their_values(torch: Any) -> None:
    """A tensor held by the rank stays as it came while the next ones reuse the pool."""
    async with aiospawn.open_group(shm_ranks.holder, nprocs=1, start_method="fork") as ctx:
        channel = ctx.channel(0)

        async def ask(*message: Any) -> Any:
            await channel.send(message)
            return await channel.receive()

        first = await ask("hold", "a", torch.full((MiB,), 1.0, dtype=torch.float64))
        second = await ask("hold", "b", torch.full((MiB,), 2.0, dtype=torch.float64))
        assert second not in (0, first), (first, second)
        assert await ask("check", "a") == (1.0, 1.0)
        await ask("drop", "a")
        assert await ask("hold", "c", torch.full((MiB,), 3.0, dtype=torch.float64)) == first
        assert await ask("check", "b") == (2.0, 2.0)
        assert await ask("check", "c") == (3.0, 3.0)


if __name__ == "__main__":
    anyio.run(main)
