"""A two-rank DDP job on CPU (gloo), for the tests that a finished rank reads as finished.

``train`` is a rank function (``fn(rank, world_size, address)``);
``cli_programs/ddp_job.py`` runs the same job as a script under ``aiospawn run``.
torch is imported inside the function: this module imports without it.
"""

from __future__ import annotations


def train(rank: int, world_size: int, address: str, destroy: bool = False) -> float:
    """Train a small model with DistributedDataParallel; return its weights' checksum.

    ``address`` is the rendezvous, ``tcp://127.0.0.1:PORT``: rank 0 serves
    torch's TCPStore from a thread of its own, as with torchrun. Without
    ``destroy``, the process group is left for the process's end to tear
    down, as many training scripts leave it.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    checksum = step(rank)
    if destroy:
        dist.destroy_process_group()
    return checksum


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


def free_address() -> str:
    """A rendezvous address on a port that is free now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"
