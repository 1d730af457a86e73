"""lightning's ``ddp_spawn`` through ``aiospawn.sync``: run as ``python -m tests.lightning_client``.

``python -m tests.lightning_client fabric OUT`` launches a function with
``Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")``, then again
with a rank that raises (in ``OUT/ok`` and ``OUT/fail``);
``python -m tests.lightning_client trainer OUT`` fits a tiny model with
``Trainer(..., strategy="ddp_spawn", max_steps=3)``, then again with a rank
whose training step raises (in ``OUT/ok`` and ``OUT/fail``). Both first put
``aiospawn.sync`` in place of ``torch.multiprocessing`` in lightning's two
multiprocessing launchers, the modules that start the ranks. Each rank leaves
its pid (and the trainer's ranks their final weights) in OUT; the program
prints one ``RESULT`` line of JSON (``tests/client_ranks.py``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.strategies.launchers import multiprocessing as fabric_launcher
from lightning.pytorch.strategies.launchers import multiprocessing as trainer_launcher

import aiospawn.sync
from tests.client_ranks import FAILING_RANK, FAILURE, describe, left_running, note_pid, report


def swap() -> None:
    """The one-line swap, made where lightning's launchers name ``torch.multiprocessing``."""
    fabric_launcher.mp = aiospawn.sync
    trainer_launcher.mp = aiospawn.sync


def data(rank: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + rank))


def fabric_job(fabric: Any, out: str, fail: bool) -> list[list[float]]:
    """A few steps of a tiny model; every rank's final weights, gathered."""
    note_pid(out, fabric.global_rank)
    torch.manual_seed(fabric.global_rank)  # different until Fabric broadcasts rank 0's
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        fabric.backward(model(data(fabric.global_rank)).pow(2).mean())
        optimizer.step()
    if fail and fabric.global_rank == FAILING_RANK:
        raise ValueError(FAILURE)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered: torch.Tensor = fabric.all_gather(weights)
    return [row.tolist() for row in gathered]


class TinyModel(lightning.LightningModule):
    """With ``fail``, rank :data:`FAILING_RANK`'s second training step raises."""

    def __init__(self, out: str, fail: bool = False) -> None:
        super().__init__()
        self.out = out
        self.fail = fail
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        if self.fail and self.global_rank == FAILING_RANK and self.global_step == 1:
            raise ValueError(FAILURE)
        loss: torch.Tensor = self.layer(batch[0]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = torch.utils.data.TensorDataset(data(0).repeat(4, 1))
        return torch.utils.data.DataLoader(dataset, batch_size=4)

    def on_train_start(self) -> None:
        note_pid(self.out, self.global_rank)

    def on_train_end(self) -> None:
        torch.save(self.state_dict(), Path(self.out, f"rank{self.global_rank}.pt"))


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")  # lightning's advice on CPU runs
    client, out = argv
    swap()
    if client == "fabric":  # a job that succeeds, then one whose rank 1 fails
        results: dict[str, Any] = {}
        for name in ("ok", "fail"):
            Path(out, name).mkdir()
            fabric = lightning.Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")
            try:
                results[name] = fabric.launch(fabric_job, str(Path(out, name)), name == "fail")
            except BaseException as exc:  # what reached the caller of launch(), whatever it is
                results[name] = describe(exc)
            results[f"{name}_left"] = left_running(str(Path(out, name)))
        report(**results)
    else:  # a fit that succeeds, then one whose rank 1 fails
        ok, fail = Path(out, "ok"), Path(out, "fail")
        ok.mkdir()
        fail.mkdir()
        torch.manual_seed(0)
        model = TinyModel(str(ok))
        trainer = make_trainer(ok)
        torch.save(model.state_dict(), ok / "start.pt")
        trainer.fit(model)
        torch.save(model.state_dict(), ok / "main.pt")
        failing = make_trainer(fail)
        error: dict[str, Any] = {"error": None}  # nothing reached the caller
        try:
            failing.fit(TinyModel(str(fail), fail=True))
        except BaseException as exc:  # what reached the caller of fit(), whatever it is
            error = describe(exc)
        report(
            finished=trainer.state.finished,
            ok_left=left_running(str(ok)),
            fail=error,
            fail_status=failing.state.status.value,
            fail_left=left_running(str(fail)),
        )


def make_trainer(out: Path) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )


if __name__ == "__main__":
    from tests import lightning_client  # the classes and functions by their module's name

    lightning_client.main(sys.argv[1:])
