"""accelerate's launchers through ``aiospawn.sync``: ``python -m tests.accelerate_client OUT``.

Runs the same tiny job with ``debug_launcher`` (ranks started by
``torch.multiprocessing.start_processes``, which accelerate imports from that
module when called) and with ``notebook_launcher`` (ranks started by
``torch.distributed.elastic``'s ``MultiprocessContext``, through the
``torch.multiprocessing`` module that ``torch.distributed.elastic.multiprocessing.api``
names ``mp``), after putting ``aiospawn.sync`` in both places; then both
again, with a rank that raises; then ``notebook_launcher`` with
``ACCELERATE_DEBUG_MODE=true``, whose check of the environment fails in its
ranks, as it does on a machine where CUDA was initialised before the fork.
Each rank saves its final weights and leaves its pid in ``OUT/debug``,
``OUT/notebook``, ``OUT/debug_fail`` or ``OUT/notebook_fail``.
``python -m tests.accelerate_client OUT check`` runs the failing check alone,
its ranks' pids in OUT.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import accelerate.launchers
import torch
import torch.distributed.elastic.multiprocessing.api as elastic_api
import torch.multiprocessing
from accelerate import Accelerator, debug_launcher, notebook_launcher
from accelerate.utils import patch_environment
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import aiospawn.sync
from tests.client_ranks import (
    FAILING_RANK,
    FAILURE,
    describe,
    left_running,
    note_pid,
    report,
    write_note,
)
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


#: The variable naming the directory where :func:`failing_environment_check` notes its pids.
CHECK_DIR = "AIOSPAWN_TEST_CHECK_DIR"


def failing_environment_check() -> None:
    """Stands in for accelerate's ``test_launch`` (``PartialState()`` in each rank).

    On a GPU machine whose parent initialised CUDA, the check fails in every
    forked rank with torch's "Cannot re-initialize CUDA in forked subprocess";
    here, on CPU, it fails with the same words for the CPU, and the rank's pid.
    accelerate calls it without the rank's index, so the rank notes its pid
    (as :func:`note_pid` does, whole or not at all) under its pid's name.
    """
    pid = os.getpid()
    write_note(Path(os.environ[CHECK_DIR], f"check{pid}.pid"))
    raise RuntimeError(f"Cannot re-initialize CPU in forked subprocess (pid {pid})")


def check_environment(out: str) -> dict[str, Any]:
    """``notebook_launcher`` with ``ACCELERATE_DEBUG_MODE``: its check fails in the ranks.

    accelerate runs the check through ``torch.multiprocessing.start_processes``
    and catches ``torch.multiprocessing.spawn.ProcessRaisedException`` (imported
    from there by name) to explain the failure: aiospawn's must be caught too.
    """
    accelerate.launchers.test_launch = failing_environment_check  # type: ignore[attr-defined]
    port = free_address().rsplit(":", 1)[1]
    failed: dict[str, Any] = {"error": None}  # nothing reached the caller
    with patch_environment(accelerate_debug_mode="true", **{CHECK_DIR: out}):
        try:
            notebook_launcher(job, args=(out,), num_processes=2, use_port=port)
        except BaseException as exc:  # what reached the caller, whatever it is
            cause = exc.__cause__
            failed = {
                "error": type(exc).__name__,
                "message": str(exc),
                "cause": None if cause is None else describe(cause),
            }
    return {"failed": failed, "left": left_running(out, "check*.pid")}


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    out, *mode = argv
    swap()
    if mode == ["check"]:
        report(**check_environment(out))
        return
    for name in ("debug", "notebook", "debug_fail", "notebook_fail"):
        Path(out, name).mkdir()
    debug_launcher(job, args=(str(Path(out, "debug")),), num_processes=2)
    failed = str(Path(out, "debug_fail"))
    debug_fail: dict[str, Any] = {"error": None}  # nothing reached the caller
    try:
        debug_launcher(job, args=(failed, True), num_processes=2)
    except BaseException as exc:  # what reached the caller, whatever it is
        debug_fail = describe(exc)
    debug_left = left_running(failed)
    port = free_address().rsplit(":", 1)[1]
    notebook_launcher(job, args=(str(Path(out, "notebook")),), num_processes=2, use_port=port)
    failed = str(Path(out, "notebook_fail"))
    port = free_address().rsplit(":", 1)[1]
    try:
        notebook_launcher(job, args=(failed, True), num_processes=2, use_port=port)
    except ChildFailedError as exc:  # the elastic agent's report, its root cause first
        rank, failure = exc.get_first_failure()
        root_cause = {"rank": rank, "message": failure.message["message"]}
    report(
        debug_fail=debug_fail,
        debug_left=debug_left,
        root_cause=root_cause,
        left=left_running(failed),
    )


if __name__ == "__main__":
    from tests import accelerate_client  # the job by its module's name

    accelerate_client.main(sys.argv[1:])
