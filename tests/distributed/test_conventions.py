"""Lightning's setup conventions, as DDPStrategy follows them: ``sync_batchnorm`` and module states outside fit.

On 2 ranks, under MultiDeepSpeedStrategy, each rank returns what it saw:

* :func:`fit_sync_batchnorm`: ``Trainer(sync_batchnorm=True)`` fits a module whose frozen ``norm`` submodule holds a
  BatchNorm; what type it has during fit and after;
* :func:`validate_evaluated`: ``trainer.validate`` of a module whose plain submodule starts different on each rank,
  beside a ZeRO-3 teacher built in ``configure_model``; that rank's weights after it.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

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


def fit_sync_batchnorm() -> dict[str, Any]:
    """On each rank: fit ``Normed`` with ``sync_batchnorm=True``; its BatchNorm's type during fit and after."""
    normed = Normed()
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"norm": {}})
    cpu_trainer(strategy, max_steps=2, sync_batchnorm=True, enable_checkpointing=False).fit(normed)
    layer = normed.norm[0]
    return {
        **normed.seen,
        "after_fit": type(layer).__name__,
        "batchnorm_after_fit": isinstance(layer, nn.modules.batchnorm._BatchNorm),
    }


def validate_evaluated() -> dict[str, Any]:
    """On each rank: ``trainer.validate(Evaluated())``; the plain weights before and after, the teacher, outputs."""
    seen: dict[str, Any] = {}
    evaluated = Evaluated()
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": ZERO3})
    trainer = cpu_trainer(strategy)
    seen["plain_before"] = {k: v.clone() for k, v in evaluated.plain.state_dict().items()}
    trainer.validate(evaluated)
    seen["plain_after"] = {k: v.clone() for k, v in evaluated.plain.state_dict().items()}
    whole = strategy.consolidated_state_dict()
    seen["teacher"] = {k.removeprefix("teacher."): v for k, v in whole.items() if k.startswith("teacher.")}
    seen["outputs"] = torch.cat(evaluated.outputs)
    return seen


def test_sync_batchnorm_converts_for_fit_and_reverts_after() -> None:
    """As under DDP: BatchNorm layers are SyncBatchNorm during fit, and a plain BatchNorm again after teardown."""
    for seen in on_ranks(fit_sync_batchnorm, timeout=300):
        assert seen["during_fit"] == "SyncBatchNorm"
        assert seen["after_fit"] != "SyncBatchNorm" and seen["batchnorm_after_fit"]  # Lightning's _BatchNormXd


def test_validate_starts_every_rank_from_rank_zero_weights() -> None:
    """Outside fit rank 0's weights reach every rank, as DDP syncs module states; ZeRO-3 partitions stay per rank."""
    rank0, rank1 = on_ranks(validate_evaluated, timeout=300)
    assert not torch.equal(rank0["plain_before"]["weight"], rank1["plain_before"]["weight"])
    for key, value in rank0["plain_before"].items():
        assert torch.equal(rank0["plain_after"][key], value)
        assert torch.equal(rank1["plain_after"][key], value)
    torch.manual_seed(0)
    teacher = nn.Linear(6, 4)
    for seen in (rank0, rank1):
        for key, value in teacher.state_dict().items():
            torch.testing.assert_close(seen["teacher"][key], value)
    real, _ = patterns.split(patterns.make_batches(2))
    expected = teacher(real).detach()
    got = torch.stack([rank0["outputs"], rank1["outputs"]], dim=1).reshape(-1, 4)  # rank r holds rows r, r + 2, ...
    torch.testing.assert_close(got, expected)
