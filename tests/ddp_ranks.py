"""A two-rank DDP job on CPU (gloo), for the tests that a finished rank reads as finished.

``train`` is a rank function (``fn(rank, world_size, init_file)``);
``cli_programs/ddp_job.py`` runs the same job as a script under ``aiospawn run``.
torch is imported inside the function: this module imports without it.
"""

from __future__ import annotations


def train(rank: int, world_size: int, init_file: str) -> float:
    """Train a small model with DistributedDataParallel; return its weights' checksum."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        return step(rank)
    finally:
        dist.destroy_process_group()


def step(rank: int) -> float:
    """A few steps of DDP on random data, in an initialised process group."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(rank)  # different weights until DDP broadcasts rank 0's
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(torch.randn(16, 8, generator=data)).pow(2).mean()
        loss.backward()
        optimizer.step()
    return round(sum(float(p.detach().sum()) for p in model.parameters()), 6)
