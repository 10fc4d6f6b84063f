"""What runs outside the engines under ``bf16-mixed``: autocast, as Lightning's ``MixedPrecision`` gives DDP.

A plain submodule (no optimizer, no engine) fed by a bf16 engine, and a loss with an fp32 class weight, run under
``torch.autocast(bfloat16)``; the engine's weights stay within bf16 resolution of plain PyTorch in fp32. An fp32
engine beside them (an EMA of the trained one) still computes in fp32.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

STEPS, PER_RANK = 2, 4


def make_modules() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6)), nn.Linear(6, 3)


def make_data() -> torch.Tensor:
    """Rows of 4 features and a class label (0-2) in the last column."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(STEPS * PER_RANK * 2, 4, generator=generator)
    labels = torch.randint(0, 3, (STEPS * PER_RANK * 2, 1), generator=generator).float()
    return torch.cat([features, labels], dim=1)


CLASS_WEIGHT = torch.tensor([1.0, 2.0, 0.5])


def loss_of(body: nn.Module, head: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Class-weighted cross entropy, summed and divided by the batch: a per-rank mean that averages to the global."""
    features, labels = batch[:, :4], batch[:, 4].long()
    weight = CLASS_WEIGHT.to(batch.device)
    return F.cross_entropy(head(body(features)), labels, weight=weight, reduction="sum") / batch.shape[0]


class PlainHead(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = make_modules()
        self.body_ema = copy.deepcopy(self.body)  # an fp32 EMA engine (`ema=` of the strategy)
        self.automatic_optimization = False
        self.ema_dtypes: list[torch.dtype] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss_of(self.body, self.head, batch))
        opt.step()
        self.ema_dtypes.append(self.body_ema(batch[:, :4]).dtype)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.body.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, make_data(), batch_size=PER_RANK)


def fit_plain_head(stage: int) -> dict[str, Any]:
    """On each rank: the fit in bf16-mixed; the body's weights at its end, whole, and the EMA's output dtypes."""
    at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
    trainer = cpu_trainer(
        MultiDeepSpeedStrategy(stage=stage, ema={"body_ema": ("body", 0.5)}),
        precision="bf16-mixed",
        callbacks=[at_end],
        use_distributed_sampler=False,
        enable_checkpointing=False,
    )
    module = PlainHead()
    casts: list[str] = []  # where each cast of a submodule to fp32 happens: the device it names
    to = nn.Module.to

    def recording(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if torch.float32 in (*args, kwargs.get("dtype")):
            casts.append(str(kwargs.get("device", next((a for a in args if isinstance(a, str | torch.device)), None))))
        return to(self, *args, **kwargs)

    with mock.patch.object(nn.Module, "to", recording):
        trainer.fit(module)
    weights = {key: value.float() for key, value in at_end.value.items() if key.startswith("body.")}
    return {"weights": weights, "ema_dtypes": module.ema_dtypes, "casts": casts}


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch in fp32, one process, on the global batch (ranks' rows interleaved, as the loader shards)."""
    body, head = make_modules()
    optimizer = torch.optim.SGD(body.parameters(), lr=0.5)
    data = make_data()
    for step in range(STEPS):
        batch = torch.cat([data[rank::2][step * PER_RANK : (step + 1) * PER_RANK] for rank in range(2)])
        optimizer.zero_grad()
        loss_of(body, head, batch).backward()
        optimizer.step()
    return {f"body.{key}": value for key, value in body.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_plain_head_and_an_fp32_loss_weight_run_under_autocast_in_bf16(stage: int) -> None:
    result = on_ranks(fit_plain_head, stage)[0]
    assert result["ema_dtypes"] == [torch.float32] * STEPS  # the fp32 engine's forward: autocast off
    # At teardown the whole bf16 body goes back to fp32 on the CPU, never as a whole fp32 copy on the accelerator.
    assert result["casts"] == (["cpu"] if stage == 0 else []), result["casts"]
    weights, expected = result["weights"], reference()
    assert weights.keys() == expected.keys()
    moved = max(
        (expected[key] - make_modules()[0].state_dict()[key.removeprefix("body.")]).abs().max() for key in expected
    )
    assert moved > 1e-2
    for key, value in expected.items():
        assert (weights[key] - value).abs().max() < 3e-2, key  # bf16 keeps ~3 significant digits
