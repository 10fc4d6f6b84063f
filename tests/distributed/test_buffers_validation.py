"""Buffers in validation during a fit: rank 0's before the validation forwards where DDPStrategy syncs them.

DDP broadcasts buffers in the pre-forward of any forward it marked as due, and marks one due after every forward
with gradients enabled (``require_forward_param_sync``); Lightning's ``validation_step`` during a fit runs through
DDP's forward. So the sanity check validates from rank 0's buffers, and in automatic optimization a validation after
training steps does too (the next training step then skips the sync). The strategy broadcast at ``training_step``
only (an adversarial review found it), so rank 1 validated from its own BatchNorm statistics, and the logged
validation loss differed from DDP's.

Rank r's ``running_mean`` starts filled with r, so which rank's statistics a step sees is plain; rank 1 records
``running_mean[0]`` at every ``training_step`` and at the first batch of every validation, under both strategies.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

Seen = list[tuple[str, int, float]]


class WithBatchNorm(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.body[1].running_mean.fill_(float(os.environ["TEST_RANK"]))
        self.seen: Seen = []

    def note(self, where: str) -> None:
        self.seen.append((where, self.global_step, round(self.body[1].running_mean[0].item(), 5)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.note("train")
        return F.mse_loss(self.body(batch[:, :4]).squeeze(1), batch[:, 4])

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if batch_idx == 0:
            self.note("sanity" if self.trainer.sanity_checking else "validation")
        self.log("val_loss", F.mse_loss(self.body(batch[:, :4]).squeeze(1), batch[:, 4]), sync_dist=True)

    def on_train_end(self) -> None:
        self.seen.append(
            ("logged val_loss", self.global_step, round(float(self.trainer.callback_metrics["val_loss"]), 5))
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.body.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.randn(32, 5, generator=torch.Generator().manual_seed(1))
        data[1::2, :4] += 3.0  # rank 1's rows: its batch statistics differ from rank 0's
        return sharded_loader(self, data)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, torch.randn(8, 5, generator=torch.Generator().manual_seed(2)))


def seen_under(strategy: str) -> Seen:
    module = WithBatchNorm()
    chosen = DDPStrategy(process_group_backend="gloo") if strategy == "ddp" else MultiDeepSpeedStrategy(stage=0)
    options = {"val_check_interval": 2, "num_sanity_val_steps": 1, "enable_checkpointing": False}
    cpu_trainer(chosen, use_distributed_sampler=False, **options).fit(module)
    return module.seen


def test_validation_sees_the_buffers_ddp_validates_from() -> None:
    assert on_ranks(seen_under, "multids")[1] == on_ranks(seen_under, "ddp")[1]
