"""Per-rank script: train a ``tests.reach`` case under MultiDeepSpeedStrategy; save rank 0's weights.

Usage: run_reach.py OUT CASE OPTIMIZER STEPS STAGE_G STAGE_D [no_sync]
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns, reach
from tests.distributed.common import AtFitEnd, cpu_trainer, finish, sharded_loader
from tests.distributed.run_patterns import backward_state

warnings.filterwarnings("ignore")


class ReachModule(pl.LightningModule):
    def __init__(self, case: str, optimizer: str, steps: int, no_sync: bool) -> None:
        super().__init__()
        self.case, self.optimizer_name, self.steps, self.no_sync = case, optimizer, steps, no_sync
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        loss = reach.LOSSES[self.case](self.generator, self.discriminator, batch, self.global_rank, batch_idx)
        if self.no_sync:
            with self.trainer.strategy.no_sync():
                self.manual_backward(loss)
        else:
            self.manual_backward(loss)
        reach.train_step(self.case, self.generator, self.discriminator, loss, opt_g, opt_d, batch_idx)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            patterns.make_optimizer(self.optimizer_name, self.generator.parameters()),
            patterns.make_optimizer(self.optimizer_name, self.discriminator.parameters()),
        ]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(self.steps))


def main() -> None:
    out, case, optimizer, steps, stage_g, stage_d, *flags = sys.argv[1:]
    module = ReachModule(case, optimizer, int(steps), "no_sync" in flags)
    strategy = MultiDeepSpeedStrategy(
        stage=int(stage_g),
        engine_configs={"discriminator": {"zero_optimization": {"stage": int(stage_d)}}},
    )
    at_end = AtFitEnd(lambda s: {name: backward_state(e) for name, e in s.engines.items()})
    trainer = cpu_trainer(strategy, callbacks=[at_end], enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(module)
    state = strategy.consolidated_state_dict()
    if trainer.global_rank == 0:
        torch.save({"weights": {k: v.float().clone() for k, v in state.items()}, "engines": at_end.value}, out)


if __name__ == "__main__":
    main()
    finish()
