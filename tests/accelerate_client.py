"""accelerate's launchers through ``aiospawn.sync``: ``python -m tests.accelerate_client OUT``.

Runs the same tiny job with ``debug_launcher`` (ranks started by
``torch.multiprocessing.start_processes``, which accelerate imports from that
module when called) and with ``notebook_launcher`` (ranks started by
``torch.distributed.elastic``'s ``MultiprocessContext``, through the
``torch.multiprocessing`` module that ``torch.distributed.elastic.multiprocessing.api``
names ``mp``), after putting ``aiospawn.sync`` in both places. Each rank saves
its final weights and leaves its pid in ``OUT/debug`` or ``OUT/notebook``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.elastic.multiprocessing.api as elastic_api
import torch.multiprocessing
from accelerate import Accelerator, debug_launcher, notebook_launcher

import aiospawn.sync
from tests.client_ranks import note_pid, report
from tests.ddp_ranks import free_address


def swap() -> None:
    """The one-line swap, made where accelerate and torch's elastic agent look the names up."""
    torch.multiprocessing.start_processes = aiospawn.sync.start_processes  # type: ignore[assignment]
    elastic_api.mp = aiospawn.sync  # type: ignore[assignment]


def job(out: str) -> None:
    """A few steps of a tiny model under an Accelerator; save this rank's final weights."""
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    note_pid(out, rank)
    torch.manual_seed(rank)  # different until DDP broadcasts rank 0's
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        optimizer.zero_grad()
        accelerator.backward(model(torch.randn(8, 4, generator=data)).pow(2).mean())
        optimizer.step()
    weights = accelerator.unwrap_model(model).state_dict()
    torch.save(weights, Path(out, f"rank{rank}.pt"))
    accelerator.end_training()


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    (out,) = argv
    swap()
    Path(out, "debug").mkdir()
    Path(out, "notebook").mkdir()
    debug_launcher(job, args=(str(Path(out, "debug")),), num_processes=2)
    port = free_address().rsplit(":", 1)[1]
    notebook_launcher(job, args=(str(Path(out, "notebook")),), num_processes=2, use_port=port)
    report(done=True)


if __name__ == "__main__":
    from tests import accelerate_client  # the job by its module's name

    accelerate_client.main(sys.argv[1:])
