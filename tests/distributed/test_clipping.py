"""``Trainer(gradient_clip_val=...)`` in automatic optimization goes through ``configure_gradient_clipping``.

On 2 ranks, :func:`fit_each_mode` trains one engine (the generator) on a regression for 4 steps with SGD, clipped
to ``CLIP``: by Lightning's own ``configure_gradient_clipping`` (``default``), or by an override that clips on even
steps only (``even_steps``). Each rank returns the weights per mode; the test reads rank 0's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks
from tests.distributed.test_patterns import TOLERANCE, assert_matches

CLIP = 0.1
STEPS = 4
MODES = ("default", "even_steps")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator, _ = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return patterns.regression_loss(self.generator, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("sgd", self.generator.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))


class ClipsEvenSteps(Regression):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.trainer.global_step % 2 == 0:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="norm")


def fit_each_mode(stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: fit once per mode at ZeRO-``stage``; the consolidated weights per mode."""
    results = {}
    for mode in MODES:
        module = Regression() if mode == "default" else ClipsEvenSteps()
        trainer = cpu_trainer(
            MultiDeepSpeedStrategy(stage=stage),
            gradient_clip_val=CLIP,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        state = trainer.strategy.consolidated_state_dict()
        results[mode] = {k: v.float().clone() for k, v in state.items()}
    return results


def reference(mode: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch: clip to ``CLIP`` before every step (``default``) or before even steps only."""
    G, _ = patterns.make_modules()
    optimizer = patterns.make_optimizer("sgd", G.parameters())
    data = patterns.make_batches(STEPS)
    for step in range(STEPS):
        patterns.regression_loss(G, data[step * 8 : (step + 1) * 8]).backward()
        if mode == "default" or step % 2 == 0:
            torch.nn.utils.clip_grad_norm_(G.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {f"generator.{k}": v.detach().clone() for k, v in G.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_overridden_configure_gradient_clipping_is_honoured(stage: int) -> None:
    results = on_ranks(fit_each_mode, stage, timeout=300)[0]
    assert (reference("default")["generator.2.bias"] - reference("even_steps")["generator.2.bias"]).abs().max() > 1e-3
    for mode in MODES:
        assert_matches(results[mode], reference(mode), TOLERANCE)
