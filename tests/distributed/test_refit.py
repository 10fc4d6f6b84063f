"""A fit after ``torch.distributed.destroy_process_group()`` trains, as under ``DDPStrategy``.

A notebook, a hyper-parameter sweep or Lightning's own test fixtures destroy the process group between fits. DeepSpeed
caches its groups and releases them only in its own ``destroy_process_group``, so the next fit's engines would use a
destroyed group. One launch fits at ZeRO 0, 1, 2 and 3 in turn, destroying the process group after each; every fit
matches plain PyTorch. It runs as one process: DeepSpeed's stale groups fail there as on several ranks, and two
forked CPU ranks that make a second gloo group on the same machine hang in its rendezvous now and then under
``DDPStrategy`` too (measured), which would test gloo, not the strategy.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import (
    AtFitEnd,
    cpu_trainer,
    global_batch,
    regression_data,
    regression_loss,
    regression_model,
    sharded_loader,
)
from tests.distributed.harness import on_ranks

STEPS, PER_RANK, STAGES = 2, 4, (0, 1, 2, 3)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = regression_model()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return regression_loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


def fit_destroy_fit() -> list[dict[str, torch.Tensor]]:
    """On each rank: fit at each stage in turn, destroying the process group after each fit."""
    weights = []
    for stage in STAGES:
        at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
        trainer = cpu_trainer(
            MultiDeepSpeedStrategy(stage=stage),
            callbacks=[at_end],
            use_distributed_sampler=False,
            enable_checkpointing=False,
        )
        trainer.fit(Regression())
        weights.append(at_end.value)
        torch.distributed.destroy_process_group()
    return weights


def reference() -> dict[str, torch.Tensor]:
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = regression_data(STEPS, PER_RANK)
    for step in range(STEPS):
        batch = global_batch(data, step, PER_RANK)
        optimizer.zero_grad()
        regression_loss(model, batch).backward()
        optimizer.step()
    return {f"net.{key}": value for key, value in model.state_dict().items()}


def test_each_fit_after_the_process_group_was_destroyed_trains() -> None:
    fits, expected = on_ranks(fit_destroy_fit, world_size=1, timeout=120)[0], reference()
    assert len(fits) == len(STAGES)
    for stage, weights in zip(STAGES, fits, strict=True):
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=f"ZeRO-{stage} {key}")
