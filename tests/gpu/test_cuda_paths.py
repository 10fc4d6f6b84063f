"""What only CUDA reaches: Lightning's device for the engines, FusedAdam's weight edits at ZeRO-0, fp16 autocast.

Each was read in the code, fixed, and tested on CPU as closely as the CPU allows (``tests/unit/test_device.py``,
``test_weight_edits.py``, ``test_precision.py``); here the real thing runs, in one process on one GPU.
``GPU_SUITE_ON_CPU=1`` runs the device case on CPU (the others need CUDA).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import AtFitEnd, cpu_trainer
from tests.gpu.test_gpu import DEVICE, ON_CPU, on_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() and not ON_CPU, reason="no CUDA: the GPU suite needs a CUDA device"
    ),
]
CUDA_ONLY = pytest.mark.skipif(ON_CPU, reason="needs CUDA (FusedAdam, fp16)")


class Body(pl.LightningModule):
    """A trained ``body`` and a plain ``head`` without an optimizer (it stays fp32, outside the engines)."""

    def __init__(self, config: dict[str, Any] | None = None, edit: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.head.requires_grad_(False)
        self.config, self.edit = config, edit

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.edit and batch_idx == 1:  # an edit between steps: every weight to 0.5, as rank 0 has it
            with self.trainer.strategy.gathered("body", modifier_rank=0) as body:  # type: ignore[attr-defined]
                for param in body.parameters():
                    param.fill_(0.5)
        return self.head(self.body(batch)).float().pow(2).mean()

    def configure_optimizers(self) -> Any:
        return None if self.config else torch.optim.SGD(self.body.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(12, 8, generator=torch.Generator().manual_seed(1)), batch_size=4)


def fit_body(precision: str, config: dict[str, Any] | None, edit: bool, devices: Any) -> dict[str, Any]:
    """Fit :class:`Body`; the engine's device, the weights at the end, and the engine's optimizer class."""
    at_end = AtFitEnd(
        lambda strategy: {
            "device": str(strategy.engines["body"].device),
            "weights": {k: v.float().cpu() for k, v in strategy.consolidated_state_dict().items()},
            "optimizer": type(strategy.engines["body"].optimizer).__name__,
        }
    )
    configs = {"body": config} if config else None
    strategy = MultiDeepSpeedStrategy(stage=0, engine_configs=configs)
    trainer = cpu_trainer(
        strategy,
        precision=precision,
        callbacks=[at_end],
        devices=devices,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Body(config, edit))
    return at_end.value


def test_the_engines_run_on_the_device_lightning_gives_the_process() -> None:
    devices = 1 if ON_CPU else [0]
    result = on_gpu(fit_body, "32-true", None, False, devices)
    assert result["device"] == DEVICE[0]


@CUDA_ONLY
def test_an_edit_of_a_zero0_bf16_engine_with_fused_adam_reaches_its_master_copy() -> None:
    """DeepSpeed gives it an ``FP16_Optimizer``; at lr 0 the weights after the steps are the edit, not the master."""
    config = {"optimizer": {"type": "Adam", "params": {"lr": 0.0}}, "bf16": {"enabled": True}}
    result = on_gpu(fit_body, "bf16-mixed", config, True, 1)
    assert result["optimizer"] == "FP16_Optimizer"
    for key, value in result["weights"].items():
        if key.startswith("body."):
            torch.testing.assert_close(value, torch.full_like(value, 0.5), rtol=0, atol=0, msg=key)


@CUDA_ONLY
def test_a_plain_fp32_head_on_an_fp16_engine_runs_under_16_mixed_as_under_ddp() -> None:
    """The fp16 engine's output meets the fp32 head under autocast, as Lightning's ``MixedPrecision`` runs it."""
    result = on_gpu(fit_body, "16-mixed", None, False, 1)
    initial = Body().body.weight.detach()
    trained = result["weights"]["body.weight"]
    assert torch.isfinite(trained).all() and not torch.allclose(trained, initial)
