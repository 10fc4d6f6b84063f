"""Per-rank script: ``strategy.offloaded(name)`` around sampling in a GAN, then training on (Adam).

Usage: run_offloaded.py OUT STEPS SPEC [SPEC ...], each SPEC ``G_STAGE:D_STAGE``. Each step offloads the
discriminator's states while the generator samples, then trains the GAN. The first step also calls the
discriminator and steps it inside the block, offloads the generator alone, nests, and names a frozen and an
unknown engine. Writes OUT on rank 0: {spec: {"weights", "states", "errors"}}.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")


class OffloadedGAN(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps = steps
        self.generator, self.discriminator = patterns.make_modules()
        self.critic = copy.deepcopy(self.discriminator)  # frozen
        self.seen: dict[str, Any] = {"states": [], "errors": {}}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, z = patterns.split(batch)
        opt_g, opt_d = self.optimizers()
        strategy = self.trainer.strategy
        with strategy.offloaded("discriminator"):
            self.seen["states"].append(sorted(str(s.value) for s in opt_d.engine.optimizer.offloaded_states))
            with torch.no_grad():
                self.generator(z)
            if batch_idx == 0:
                self.attempt("forward", lambda: self.discriminator(z))
                self.attempt("step", opt_d.step)
                self.attempt("nested", lambda: offload(strategy, "discriminator"))
        self.seen["states"].append(sorted(str(s.value) for s in opt_d.engine.optimizer.offloaded_states))
        if batch_idx == 0:
            for name in ("generator", "critic", "actor"):  # trainable at the spec's stage, frozen, unknown
                self.attempt(name, lambda name=name: offload(strategy, name))
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def attempt(self, what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except (ValueError, RuntimeError) as error:
            self.seen["errors"][what] = str(error)
        else:
            self.seen["errors"][what] = "no error"

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(self.steps))


def offload(strategy: MultiDeepSpeedStrategy, name: str) -> None:
    with strategy.offloaded(name):
        pass


def main() -> None:
    out, steps, *specs = sys.argv[1:]
    results = {}
    for spec in specs:
        g_stage, d_stage = map(int, spec.split(":"))
        module = OffloadedGAN(int(steps))
        strategy = MultiDeepSpeedStrategy(
            engine_configs={
                "generator": {"zero_optimization": {"stage": g_stage}},
                "discriminator": {"zero_optimization": {"stage": d_stage}},
                "critic": {"zero_optimization": {"stage": 0}},
            }
        )
        trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
        trainer.fit(module)
        weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
        results[spec] = {"weights": weights, **module.seen}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
