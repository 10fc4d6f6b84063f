"""Per-rank script: ``strategy.gathered(name)`` around sampling in a ZeRO-3 GAN, with a frozen ZeRO-3 copy beside it.

Usage: run_gathered.py OUT STEPS. Each step samples the generator and the frozen copy inside ``gathered`` and
outside it (ZeRO-3's per-layer gathering), runs the discriminator (whose small parameters ZeRO-3 keeps whole:
its default persistence threshold) inside ``gathered``, then trains the GAN. The first step also raises inside a
block, nests one, names an unknown engine and steps inside a block. Writes OUT.RANK: weights after fit and what
each block saw.
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._blocks import BlockError
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def whole(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` holds its whole data on this rank now."""
    return all(p.data.numel() == p.ds_numel for p in module.parameters())


class GatheredGAN(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps = steps
        self.generator, self.discriminator = patterns.make_modules()
        self.teacher = copy.deepcopy(self.generator)
        self.seen: dict[str, Any] = {"max_diff": 0.0, "whole_inside": [], "whole_after": [], "errors": []}
        # whole_after: whether the submodule was whole after the block, or after a forward following it

    def sample(self, name: str, z: torch.Tensor) -> None:
        module = getattr(self, name)
        with torch.no_grad():
            layered = module(z)
        with self.trainer.strategy.gathered(name) as gathered:
            assert gathered is module
            inside = whole(module)
            out = gathered(z)
            self.seen["whole_inside"].append(inside and whole(module) and not torch.is_grad_enabled())
        after_block = whole(module)
        with torch.no_grad():
            module(z)  # ZeRO-3's hooks are back: the forward gathers each layer and releases it after
        self.seen["whole_after"].append(after_block or whole(module))
        self.seen["max_diff"] = max(self.seen["max_diff"], (out - layered).abs().max().item())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, z = patterns.split(batch)
        if batch_idx == 0:
            self.misuse(z)
        self.sample("generator", z)
        self.sample("teacher", z)
        with self.trainer.strategy.gathered("discriminator") as discriminator:  # persistent parameters: whole always
            discriminator(patterns.split(batch)[0])
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def misuse(self, z: torch.Tensor) -> None:
        strategy = self.trainer.strategy
        try:
            with strategy.gathered("generator") as generator:
                generator(z)
                raise RuntimeError("raised inside the block")
        except RuntimeError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("generator"), strategy.gathered("generator"):
                pass
        except BlockError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("critic"):
                pass
        except ValueError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("generator"):
                self.optimizers()[0].step()
        except RuntimeError as error:
            self.seen["errors"].append(str(error))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(self.steps))


def main() -> None:
    out, steps = sys.argv[1:]
    module = GatheredGAN(int(steps))
    strategy = MultiDeepSpeedStrategy(
        engine_configs={"generator": ZERO3, "discriminator": {"zero_optimization": {"stage": 3}}, "teacher": ZERO3},
    )
    trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(module)
    weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
    torch.save({"weights": weights, **module.seen}, f"{out}.{torch.distributed.get_rank()}")


if __name__ == "__main__":
    main()
    finish()
