"""accelerate's launchers through ``aiospawn.sync``: ``python -m tests.accelerate_client OUT``.

Runs the same tiny job with ``debug_launcher`` (ranks started by
``torch.multiprocessing.start_processes``, which accelerate imports from that
module when called) and with ``notebook_launcher`` (ranks started by
``torch.distributed.elastic``'s ``MultiprocessContext``, through the
``torch.multiprocessing`` module that ``torch.distributed.elastic.multiprocessing.api``
names ``mp``), after putting ``aiospawn.sync`` in both places; then
``notebook_launcher`` again, with a rank that raises. Each rank saves its final
weights and leaves its pid in ``OUT/debug``, ``OUT/notebook`` or
``OUT/notebook_fail``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.elastic.multiprocessing.api as elastic_api
import torch.multiprocessing
from accelerate import Accelerator, debug_launcher, notebook_launcher
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import aiospawn.sync
from tests.client_ranks import FAILING_RANK, FAILURE, left_running, note_pid, report
from tests.ddp_ranks import free_address


def swap() -> None:
    """The one-line swap, made where accelerate and torch's elastic agent look the names up."""
    torch.multiprocessing.start_processes = aiospawn.sync.start_processes  # type: ignore[assignment]
    elastic_api.mp = aiospawn.sync  # type: ignore[assignment]


def job(out: str, fail: bool = False) -> None:
    """A few steps of a tiny model under an Accelerator; save this rank's final weights.

    With ``fail``, rank :data:`FAILING_RANK` raises after its first step.
    """
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    note_pid(out, rank)
    torch.manual_seed(rank)  # different until DDP broadcasts rank 0's
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(100 + rank)
    for index in range(3):
        if fail and rank == FAILING_RANK and index == 1:
            raise ValueError(FAILURE)
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
    for name in ("debug", "notebook", "notebook_fail"):
        Path(out, name).mkdir()
    debug_launcher(job, args=(str(Path(out, "debug")),), num_processes=2)
    port = free_address().rsplit(":", 1)[1]
    notebook_launcher(job, args=(str(Path(out, "notebook")),), num_processes=2, use_port=port)
    failed = str(Path(out, "notebook_fail"))
    port = free_address().rsplit(":", 1)[1]
    try:
        notebook_launcher(job, args=(failed, True), num_processes=2, use_port=port)
    except ChildFailedError as exc:  # the elastic agent's report, its root cause first
        rank, failure = exc.get_first_failure()
        root_cause = {"rank": rank, "message": failure.message["message"]}
    report(root_cause=root_cause, left=left_running(failed))


if __name__ == "__main__":
    from tests import accelerate_client  # the job by its module's name

    accelerate_client.main(sys.argv[1:])
