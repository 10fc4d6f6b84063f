"""Per-rank script: Lightning's setup conventions that DDPStrategy follows, under MultiDeepSpeedStrategy.

Usage: run_conventions.py OUT CASE

CASE is one of:

* ``sync_batchnorm``: ``Trainer(sync_batchnorm=True)`` fits a module whose frozen ``norm`` submodule holds a
  BatchNorm; what type it has during fit and after;
* ``validate``: ``trainer.validate`` of a module whose plain submodule starts different on each rank, beside
  a ZeRO-3 teacher built in ``configure_model``; both ranks' weights after it.

Every rank saves what it saw in ``OUT.rankN``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
ZERO3 = {"zero_optimization": {"stage": 3}}


class Normed(pl.LightningModule):
    """A trained generator after a frozen BatchNorm (a frozen engine: always in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.Sequential(nn.BatchNorm1d(6))
        self.generator = nn.Linear(6, 4)
        self.seen: dict[str, Any] = {}

    def on_fit_start(self) -> None:
        self.seen["during_fit"] = type(self.norm[0]).__name__

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.generator(self.norm(batch[:, :6])).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.generator.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(2))


class Evaluated(pl.LightningModule):
    """A plain submodule initialized from each rank's own seed, and a ZeRO-3 teacher from one seed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))  # built before the process group exists
        self.plain = nn.Linear(6, 4)
        self.outputs: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if not hasattr(self, "teacher"):
            torch.manual_seed(0)
            self.teacher = nn.Linear(6, 4)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.outputs.append(self.teacher(batch[:, :6]).detach().clone())

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(2))


def main() -> None:
    out, case = sys.argv[1:]
    seen: dict[str, Any] = {}
    if case == "sync_batchnorm":
        normed = Normed()
        strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"norm": {}})
        cpu_trainer(strategy, max_steps=2, sync_batchnorm=True, enable_checkpointing=False).fit(normed)
        layer = normed.norm[0]
        seen = {
            **normed.seen,
            "after_fit": type(layer).__name__,
            "batchnorm_after_fit": isinstance(layer, nn.modules.batchnorm._BatchNorm),
        }
    else:
        evaluated = Evaluated()
        strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": ZERO3})
        trainer = cpu_trainer(strategy)
        seen["plain_before"] = {k: v.clone() for k, v in evaluated.plain.state_dict().items()}
        trainer.validate(evaluated)
        seen["plain_after"] = {k: v.clone() for k, v in evaluated.plain.state_dict().items()}
        whole = strategy.consolidated_state_dict()
        seen["teacher"] = {k.removeprefix("teacher."): v for k, v in whole.items() if k.startswith("teacher.")}
        seen["outputs"] = torch.cat(evaluated.outputs)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(seen, f"{out}.rank{rank}")
    finish()


if __name__ == "__main__":
    main()
