"""Rank functions and helpers of the real-client tests (``tests/test_real_clients.py``).

The DDP job here saves its final weights, so that two ways of running it can be
compared bit for bit. The client programs, ``tests/lightning_client.py`` and
``tests/accelerate_client.py``, run in a process of their own: each puts
``aiospawn.sync`` where the client uses ``torch.multiprocessing``, runs the
client's own entry point, and prints one ``RESULT`` line of JSON (:func:`report`).
torch is imported inside the functions: this module imports without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The rank of a job that fails on purpose, and its words.
FAILING_RANK = 1
FAILURE = "rank 1: a bad batch"


def report(**fields: Any) -> None:
    """Print one line of JSON for the test to read."""
    print("RESULT " + json.dumps(fields), flush=True)


def describe(exc: BaseException) -> dict[str, Any]:
    """What reached a client's caller: its class, whether aiospawn's and torch's
    ``ProcessRaisedException`` catch it, the rank and pid it names, and its cause."""
    import torch.multiprocessing

    import aiospawn

    return {
        "error": type(exc).__name__,
        "aiospawn": isinstance(exc, aiospawn.ProcessRaisedException),
        "torch": isinstance(exc, torch.multiprocessing.ProcessRaisedException),
        "index": getattr(exc, "error_index", None),
        "pid": getattr(exc, "error_pid", None),
        "cause": repr(exc.__cause__),
    }


def pid_file(directory: str, rank: int) -> Path:
    return Path(directory, f"rank{rank}.pid")


def note_pid(directory: str, rank: int) -> None:
    """Leave this rank's pid where the test finds it (to check that no rank is left).

    And whether the rank leads its process group, as aiospawn's ranks do and
    torch's do not: the sign that aiospawn started it.
    """
    write_note(pid_file(directory, rank))


def write_note(path: Path) -> None:
    """Write this process's pid and whether it leads its process group to ``path``, whole.

    Written aside, then renamed: a rank stopped midway (its siblings failed
    first) leaves no note, rather than an empty one.
    """
    pid = os.getpid()
    aside = path.with_name(f".{path.name}.{pid}")
    aside.write_text(f"{pid} {int(os.getpgid(0) == pid)}")
    os.replace(aside, path)


def left_running(directory: str, notes: str = "rank*.pid") -> list[int]:
    """The ranks' pids (from their ``notes`` in ``directory``) that still exist, zombies included.

    Called by the program that started the ranks, as soon as its launch call
    returned or raised: aiospawn has reaped every rank by then.
    """
    left = []
    for path in Path(directory).glob(notes):
        pid = int(path.read_text().split()[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        left.append(pid)
    return left


# A DDP job, run by torch.multiprocessing.spawn and aiospawn.sync.spawn -------


def ddp_weights(rank: int, world_size: int, address: str, out: str, fail: bool = False) -> None:
    """Train a tiny linear model with DDP (gloo), fixed seeds; save rank's final weights.

    With ``fail``, rank :data:`FAILING_RANK` raises after its first step, and
    the others are left waiting in their next step's all-reduce.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    note_pid(out, rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    torch.manual_seed(rank)  # different weights until DDP broadcasts rank 0's
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    for index in range(4):
        if fail and rank == FAILING_RANK and index == 1:
            raise ValueError(FAILURE)
        optimizer.zero_grad()
        model(torch.randn(16, 8, generator=data)).pow(2).mean().backward()
        optimizer.step()
    state = {name: tensor.detach().clone() for name, tensor in model.module.state_dict().items()}
    torch.save(state, Path(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
