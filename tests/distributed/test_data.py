"""One ``train_dataloader()`` call per fit, and the engines' batch size from the real per-process batch; 2 ranks.

Cases: ``single`` (one DataLoader of 4 per process, re-instantiated by Lightning with its distributed sampler) and
``combined`` (a dict of two DataLoaders, 4 and 2 per process). Each rank reports, per case, how often
``train_dataloader()`` ran, the engines' ``train_micro_batch_size_per_gpu`` and the batches it saw.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer
from tests.distributed.harness import on_ranks

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


def fit_each_case() -> dict[str, dict[str, Any]]:
    """On each rank: fit every case; what it saw."""
    results = {}
    for case in ("single", "combined"):
        module = Loaders(case)
        micro = AtFitEnd(lambda s: {n: e.train_micro_batch_size_per_gpu() for n, e in s.engines.items()})
        trainer = cpu_trainer(MultiDeepSpeedStrategy(stage=2), callbacks=[micro], enable_checkpointing=False)
        trainer.fit(module)
        results[case] = {"calls": module.calls, "micro": micro.value, "batches": module.batches}
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return on_ranks(fit_each_case, timeout=300)


@pytest.mark.parametrize("case", ["single", "combined"])
def test_train_dataloader_runs_once_per_fit(ranks: list[dict], case: str) -> None:
    assert [results[case]["calls"] for results in ranks] == [1, 1]


@pytest.mark.parametrize("case", ["single", "combined"])
def test_engines_get_the_per_process_batch_size(ranks: list[dict], case: str) -> None:
    """4 per process: the DataLoader's own, or the first of several (as Lightning's batch-size inference)."""
    for results in ranks:
        assert results[case]["micro"] == {"generator": 4, "discriminator": 4}


def test_lightning_still_shards_the_loader_it_got_at_setup(ranks: list[dict]) -> None:
    """The loader requested at setup still gets Lightning's DistributedSampler: 32 samples, 4 per batch, 2 ranks."""
    for results in ranks:
        assert results["single"]["batches"] == SAMPLES // (4 * 2)
