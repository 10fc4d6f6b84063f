"""Keyword arguments of ``opt.step(...)`` reach the optimizer DeepSpeed steps, or are refused naming them.

Lightning passes ``LightningOptimizer.step(closure, **kwargs)`` on to the optimizer's ``step``; under ``DDPStrategy``
an optimizer whose ``step`` takes ``scale=`` gets it. The weights match plain PyTorch given the same arguments.
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

STEPS, PER_RANK, SCALE = 2, 4, 0.25


class ScaledSGD(torch.optim.SGD):
    """SGD whose ``step`` takes a factor for this step's learning rate."""

    @torch.no_grad()
    def step(self, closure: Any = None, scale: float = 1.0) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] * scale)


class Scaled(pl.LightningModule):
    def __init__(self, optimizer: type[torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net, self.optimizer_class = regression_model(), optimizer
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(regression_loss(self.net, batch))
        opt.step(scale=SCALE)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_class(self.net.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


def fit_scaled(stage: int) -> dict[str, Any]:
    """On each rank: the weights after fitting with ScaledSGD, and the error a plain SGD gives for ``scale=``."""
    at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
    options = {"use_distributed_sampler": False, "enable_checkpointing": False}
    strategy = MultiDeepSpeedStrategy(stage=stage, elementwise_optimizers=[ScaledSGD])  # its own step: declared
    cpu_trainer(strategy, callbacks=[at_end], **options).fit(Scaled(ScaledSGD))
    try:
        cpu_trainer(MultiDeepSpeedStrategy(stage=stage), **options).fit(Scaled(torch.optim.SGD))
        error = "no error"
    except TypeError as err:
        error = str(err)
    return {"weights": at_end.value, "error": error}


def reference() -> dict[str, torch.Tensor]:
    model = regression_model()
    optimizer = ScaledSGD(model.parameters(), lr=0.5)
    data = regression_data(STEPS, PER_RANK)
    for step in range(STEPS):
        batch = global_batch(data, step, PER_RANK)
        optimizer.zero_grad()
        regression_loss(model, batch).backward()
        optimizer.step(scale=SCALE)
    return {f"net.{key}": value for key, value in model.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 2])
def test_step_keyword_arguments_reach_the_optimizer_or_are_refused(stage: int) -> None:
    result, expected = on_ranks(fit_scaled, stage)[0], reference()
    unscaled = regression_model().state_dict()
    assert max((expected[f"net.{k}"] - v).abs().max() for k, v in unscaled.items()) > 1e-2  # the steps moved
    for key, value in expected.items():
        torch.testing.assert_close(result["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert result["error"] == (
        "`opt.step(scale=...)` of engine 'net': `torch.optim.sgd.SGD.step` takes no argument 'scale', so it cannot "
        "be passed on. Remove it, or give 'net' an optimizer whose `step` takes it."
    )
