"""A ``LightningModule.backward`` override that skips the backward leaves the step without gradients, as under DDP.

Lightning documents ``backward`` as a hook a module may override; one that returns without backpropagating (to skip
a batch) gives the optimizer no gradients, so under ``DDPStrategy`` that step changes nothing (torch's optimizers pass
over a parameter whose ``grad`` is None, Adam's moments included). The weights match plain PyTorch skipping the same
steps; the no-reach error is kept for a backward that ran and reached nothing.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
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

STEPS, PER_RANK, SKIPPED = 4, 4, (1, 2)


class Skipping(pl.LightningModule):
    """Automatic optimization whose ``backward`` override skips the batches in ``SKIPPED``."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.skip = regression_model(), False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.skip = batch_idx in SKIPPED
        return regression_loss(self.net, batch)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not self.skip:
            super().backward(loss, *args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=0.05)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


def fit_skipping(stage: int) -> dict[str, torch.Tensor]:
    """On each rank: the weights after a fit that skips some backwards."""
    at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
    options = {"use_distributed_sampler": False, "enable_checkpointing": False}
    cpu_trainer(MultiDeepSpeedStrategy(stage=stage), callbacks=[at_end], **options).fit(Skipping())
    return at_end.value


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch on the global batch, stepping only where the backward ran."""
    model = regression_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    data = regression_data(STEPS, PER_RANK)
    for step in range(STEPS):
        if step in SKIPPED:
            continue
        batch = global_batch(data, step, PER_RANK)
        optimizer.zero_grad()
        regression_loss(model, batch).backward()
        optimizer.step()
    return {f"net.{key}": value for key, value in model.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_backward_override_that_skips_leaves_the_step_without_gradients(stage: int) -> None:
    result, expected = on_ranks(fit_skipping, stage)[0], reference()
    for key, value in expected.items():
        torch.testing.assert_close(result[key], value, rtol=1e-5, atol=1e-6, msg=key)
