"""Per-rank script: ``Trainer(gradient_clip_val=...)`` in automatic optimization, with and without an override.

Usage: run_clipping.py OUT STAGE

One engine (the generator) trained on a regression for 4 steps with SGD, clipped to ``CLIP``: by Lightning's
own ``configure_gradient_clipping`` (``default``), or by an override that clips on even steps only
(``even_steps``). Rank 0 saves the weights per mode.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
CLIP = 0.1
STEPS = 4
MODES = ("default", "even_steps")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator, _ = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return patterns.regression_loss(self.generator, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("sgd", self.generator.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))


class ClipsEvenSteps(Regression):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.trainer.global_step % 2 == 0:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="norm")


def main() -> None:
    out, stage = sys.argv[1:]
    results = {}
    for mode in MODES:
        module = Regression() if mode == "default" else ClipsEvenSteps()
        trainer = cpu_trainer(
            MultiDeepSpeedStrategy(stage=int(stage)),
            gradient_clip_val=CLIP,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        state = trainer.strategy.consolidated_state_dict()
        results[mode] = {k: v.float().clone() for k, v in state.items()}
    if trainer.global_rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
