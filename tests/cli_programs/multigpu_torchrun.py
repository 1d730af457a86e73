"""A small DDP training script in the style of the torchrun tutorials: ``TOTAL_EPOCHS SAVE_EVERY``.

Run by torchrun as ``torchrun --standalone --nproc_per_node=gpu
multigpu_torchrun.py 50 10``. It trains a small linear model on random data
with ``DistributedDataParallel`` (gloo, on CPUs; NCCL when there are GPUs),
saves a snapshot every SAVE_EVERY epochs from rank 0, and at the end prints
one JSON line per rank: its variables and a checksum of its weights, which
DDP keeps equal on every rank.
"""

import argparse
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(total_epochs: int, save_every: int, batch_size: int) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    )
    loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data))
    torch.manual_seed(int(os.environ["RANK"]))  # different weights until DDP broadcasts rank 0's
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    snapshots = os.environ.get("SNAPSHOT_DIR", tempfile.gettempdir())
    for epoch in range(total_epochs):
        loader.sampler.set_epoch(epoch)
        for source, target in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(source.to(device)), target.to(device))
            loss.backward()
            optimizer.step()
        if os.environ["RANK"] == "0" and epoch % save_every == 0:
            torch.save(model.module.state_dict(), os.path.join(snapshots, "snapshot.pt"))
    checksum = sum(float(parameter.detach().sum()) for parameter in model.parameters())
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"]
    shown = {name: os.environ.get(name) for name in names}
    print(json.dumps({**shown, "checksum": round(checksum, 6), "host": socket.gethostname()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    options = parser.parse_args()
    main(options.total_epochs, options.save_every, options.batch_size)
