"""Weight edits between steps reach what the next step updates, as under ``DDPStrategy``.

ZeRO-1/2, and bf16 at ZeRO-0/1, step an fp32 master copy of each rank's partition and then overwrite the module's
weights from it. A module that loads other weights when training starts (``load_state_dict`` in
``on_train_start``) and shrinks its weights after every step (``p.data.mul_``, as WGAN's clamp or SwAV's
normalisation edit them) matches plain PyTorch doing the same: in fp32 to float tolerance, in bf16 within its
resolution. Adam, so that a step from the wrong weights cannot be undone by the next one.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

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

STEPS, PER_RANK, SHRINK = 3, 4, 0.8
CASES = [(1, "32-true"), (2, "32-true"), (0, "bf16-mixed"), (2, "bf16-mixed")]


def shrink(model: nn.Module) -> None:
    for param in model.parameters():
        param.data.mul_(SHRINK)


class Edited(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = regression_model(0)
        self.automatic_optimization = False

    def on_train_start(self) -> None:
        self.net.load_state_dict(regression_model(7).state_dict())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(regression_loss(self.net, batch))
        opt.step()
        shrink(self.net)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=0.05)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


def fit_edited() -> list[dict[str, torch.Tensor]]:
    """On each rank: the weights after each case's fit."""
    weights = []
    for stage, precision in CASES:
        at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
        options = {"use_distributed_sampler": False, "enable_checkpointing": False, "precision": precision}
        cpu_trainer(MultiDeepSpeedStrategy(stage=stage), callbacks=[at_end], **options).fit(Edited())
        weights.append({key: value.float() for key, value in at_end.value.items()})
    return weights


def reference() -> dict[str, torch.Tensor]:
    model = regression_model(7)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    data = regression_data(STEPS, PER_RANK)
    for step in range(STEPS):
        batch = global_batch(data, step, PER_RANK)
        optimizer.zero_grad()
        regression_loss(model, batch).backward()
        optimizer.step()
        shrink(model)
    return {f"net.{key}": value for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def fits() -> list[dict[str, torch.Tensor]]:
    return on_ranks(fit_edited)[0]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"zero{s}-{p}" for s, p in CASES])
def test_weight_edits_between_steps_reach_the_next_step(fits: list[dict[str, torch.Tensor]], case: int) -> None:
    expected, precision = reference(), CASES[case][1]
    tolerance = 1e-5 if precision == "32-true" else 3e-2  # bf16 keeps ~3 significant digits
    for key, value in expected.items():
        assert (fits[case][key] - value).abs().max() < tolerance, key
