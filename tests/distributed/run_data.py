"""Per-rank script: the training dataloaders are requested once per fit and give the engines their batch size.

Usage: run_data.py OUT

Cases: ``single`` (one DataLoader of 4 per process, re-instantiated by Lightning with its distributed
sampler) and ``combined`` (a dict of two DataLoaders, 4 and 2 per process). Rank 0 saves, per case, how often
``train_dataloader()`` ran, the engines' ``train_micro_batch_size_per_gpu`` and the batches each rank saw.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, finish

warnings.filterwarnings("ignore")
SAMPLES = 32


class Loaders(pl.LightningModule):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.generator, self.discriminator = patterns.make_modules()
        self.calls = 0
        self.batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        data = batch if self.case == "single" else torch.cat([batch["real"][:2, :6], batch["noise"]], dim=1)
        patterns.gan(self.generator, self.discriminator, data, opt_g, opt_d, self.manual_backward)
        self.batches += 1

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("sgd", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> Any:
        self.calls += 1
        data = patterns.make_batches(SAMPLES // 8)
        if self.case == "single":
            return torch.utils.data.DataLoader(data, batch_size=4)  # Lightning adds a DistributedSampler
        return {
            "real": torch.utils.data.DataLoader(data, batch_size=4),
            "noise": torch.utils.data.DataLoader(data[:, 6:], batch_size=2),
        }


def main() -> None:
    out = sys.argv[1]
    results = {}
    for case in ("single", "combined"):
        module = Loaders(case)
        micro = AtFitEnd(lambda s: {n: e.train_micro_batch_size_per_gpu() for n, e in s.engines.items()})
        trainer = cpu_trainer(MultiDeepSpeedStrategy(stage=2), callbacks=[micro], enable_checkpointing=False)
        trainer.fit(module)
        results[case] = {"calls": module.calls, "micro": micro.value, "batches": module.batches}
    if trainer.global_rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
