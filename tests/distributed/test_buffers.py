"""Buffers follow rank 0's, as ``DDPStrategy`` broadcasts them before each training step's forward.

A BatchNorm inside a trained engine: each rank's running statistics after the fit match plain PyTorch replaying
both ranks on one process, where each step (each accumulation window's first) starts every rank from rank 0's
statistics (DDP's default, ``broadcast_buffers=True``) or, with ``broadcast_buffers=False``, from its own.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

STEPS, PER_RANK = 4, 4
Buffers = dict[str, torch.Tensor]


def make_body() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def make_data() -> torch.Tensor:
    """Rows of 4 features and a target; rank 1's rows are shifted, so the ranks' batch statistics differ."""
    data = torch.randn(STEPS * PER_RANK * 2, 5, generator=torch.Generator().manual_seed(1))
    data[1::2, :4] += 3.0
    return data


def loss_of(body: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(body(batch[:, :4]).squeeze(1), batch[:, 4])


class WithBatchNorm(pl.LightningModule):
    """``late``: the body (and so every buffer) is made in ``configure_model``, after the module is built."""

    def __init__(self, manual: bool, late: bool = False) -> None:
        super().__init__()
        self.late = late
        if not late:
            self.body = make_body()
        self.automatic_optimization = not manual

    def configure_model(self) -> None:
        if self.late and not hasattr(self, "body"):
            self.body = make_body()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if self.automatic_optimization:
            return loss_of(self.body, batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss_of(self.body, batch))
        opt.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.body.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, make_data(), batch_size=PER_RANK)


def buffers_after_fit(stage: int, broadcast: bool, accumulate: int, late: bool) -> Buffers:
    """On each rank: the body's buffers when the fit ends (automatic optimization where ``accumulate`` > 1)."""
    at_end = AtFitEnd(lambda strategy: {k: v.clone() for k, v in strategy.lightning_module.body.named_buffers()})
    strategy = MultiDeepSpeedStrategy(stage=stage, broadcast_buffers=broadcast)
    trainer = cpu_trainer(
        strategy,
        callbacks=[at_end],
        use_distributed_sampler=False,
        enable_checkpointing=False,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(WithBatchNorm(manual=accumulate == 1, late=late))
    return at_end.value


def reference(broadcast: bool, accumulate: int) -> list[Buffers]:
    """Plain PyTorch, one process: each rank's buffers after the fit, its forward run from its own buffers.

    With ``broadcast``, rank 1 starts from rank 0's buffers at the first batch of each accumulation window, as DDP
    (whose forwards under ``no_sync`` leave the next one unsynced).
    """
    body = make_body()
    optimizer = torch.optim.SGD(body.parameters(), lr=0.1)
    data = make_data()
    own = [{k: v.clone() for k, v in body.named_buffers()} for _ in range(2)]
    for step in range(STEPS):
        if broadcast and step % accumulate == 0:
            own[1] = {k: v.clone() for k, v in own[0].items()}
        losses = []
        for rank in range(2):  # BatchNorm updates the buffers it is given in place
            batch = data[rank::2][step * PER_RANK : (step + 1) * PER_RANK]
            losses.append(loss_of(lambda x, rank=rank: functional_call(body, own[rank], (x,)), batch))
        (sum(losses) / 2 / accumulate).backward()
        if (step + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return own


@pytest.mark.parametrize(
    ("stage", "broadcast", "accumulate", "late"),
    [(0, True, 1, True), (3, True, 1, False), (2, False, 1, False), (2, True, 2, False)],
)
def test_each_rank_runs_from_rank_zeros_buffers_as_under_ddp(
    stage: int, broadcast: bool, accumulate: int, late: bool
) -> None:
    """``late``: buffers made in ``configure_model`` are broadcast too (the strategy looks for them at its setup)."""
    results = on_ranks(buffers_after_fit, stage, broadcast, accumulate, late)
    expected, other = reference(broadcast, accumulate), reference(not broadcast, accumulate)
    assert (other[1]["1.running_mean"] - expected[1]["1.running_mean"]).abs().max() > 1e-2  # the test can tell
    for rank in range(2):
        assert results[rank].keys() == expected[rank].keys()
        for name, value in expected[rank].items():
            torch.testing.assert_close(results[rank][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
