"""Per-rank script: rank 1 raises, in training_step (MODE ``step``) or during setup (MODE ``setup``); or, at ZeRO-3,
only rank R enters ``strategy.gathered`` in training_step (MODE ``gatheredR``).

Usage: run_failure.py MODE
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer

warnings.filterwarnings("ignore")


class Failing(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.mode == "step" and batch_idx == 1 and self.global_rank == 1:
            raise RuntimeError("rank 1 failed on purpose in training_step")
        if self.mode == f"gathered{self.global_rank}" and batch_idx == 1:
            with self.trainer.strategy.gathered("discriminator") as discriminator:  # type: ignore[attr-defined]
                discriminator(torch.zeros(1, 6))
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        if self.mode == "setup" and self.global_rank == 1:
            raise RuntimeError("rank 1 failed on purpose during setup")
        return [patterns.make_optimizer("sgd", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(4), batch_size=4)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("gathered"):
        strategy = MultiDeepSpeedStrategy(stage=3, gathered_timeout=timedelta(seconds=10))
    else:
        strategy = MultiDeepSpeedStrategy(stage=2)
    cpu_trainer(strategy, enable_checkpointing=False).fit(Failing(mode))
