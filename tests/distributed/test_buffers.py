"""Buffers follow rank 0's where ``DDPStrategy`` broadcasts them: before each forward it syncs.

A BatchNorm inside a trained engine: each rank's running statistics after the fit match plain PyTorch replaying
both ranks on one process, where a step starts every rank from rank 0's statistics (DDP's default,
``broadcast_buffers=True``) or, with ``broadcast_buffers=False``, from its own. In automatic optimization DDP syncs
before each step (each accumulation window's first); in manual optimization before the first step of the fit only:
Lightning turns DDP's gradient sync off after the forward that wraps each ``training_step``, so DDP marks its next
forward unsynced. The manual case also runs under ``DDPStrategy`` in the same processes, which must give the same.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
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


def buffers_after_fit(stage: int, broadcast: bool, accumulate: int, late: bool) -> tuple[Buffers, Buffers | None]:
    """On each rank: the body's buffers when the fit ends (automatic optimization where ``accumulate`` > 1), and
    (manual optimization with ``broadcast``) DDPStrategy's on the same module and data."""
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
    if accumulate > 1 or not broadcast:
        return at_end.value, None
    under_ddp = WithBatchNorm(manual=True, late=late)
    ddp = DDPStrategy(process_group_backend="gloo")
    cpu_trainer(ddp, use_distributed_sampler=False, enable_checkpointing=False).fit(under_ddp)
    return at_end.value, {k: v.clone() for k, v in under_ddp.body.named_buffers()}


def reference(broadcast: bool, accumulate: int, each_step: bool = False) -> list[Buffers]:
    """Plain PyTorch, one process: each rank's buffers after the fit, its forward run from its own buffers.

    With ``broadcast``, rank 1 starts from rank 0's buffers at the first batch of each accumulation window, as DDP
    (whose forwards under ``no_sync`` leave the next one unsynced), in automatic optimization (``accumulate`` > 1
    here); at the first step only in manual optimization (``accumulate`` 1), as ``DDPStrategy``, where every rank
    holds the same buffers anyway. ``each_step``: at every step in manual optimization too, what DDP does not do.
    """
    body = make_body()
    optimizer = torch.optim.SGD(body.parameters(), lr=0.1)
    data = make_data()
    own = [{k: v.clone() for k, v in body.named_buffers()} for _ in range(2)]
    for step in range(STEPS):
        if broadcast and step % accumulate == 0 and (accumulate > 1 or step == 0 or each_step):
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
    expected = reference(broadcast, accumulate)
    other = reference(True, 1, each_step=True) if accumulate == 1 else reference(not broadcast, accumulate)
    assert (other[1]["1.running_mean"] - expected[1]["1.running_mean"]).abs().max() > 1e-2  # the test can tell
    for rank, (found, under_ddp) in enumerate(results):
        assert found.keys() == expected[rank].keys()
        for name, value in expected[rank].items():
            torch.testing.assert_close(found[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
            if under_ddp is not None:
                torch.testing.assert_close(under_ddp[name], value, rtol=1e-5, atol=1e-6, msg=f"DDP, rank {rank}")
