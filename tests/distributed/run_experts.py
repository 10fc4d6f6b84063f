"""Per-rank script: two engines of 4 experts each, rank 0's loss using experts {0, 3}, rank 1's {1, 2}.

Usage: run_experts.py OUT STAGE_A STAGE_B

Each rank reaches as many parameters of each engine as the other, but not the same ones (top-2 routing that
differs per rank): the ranks must compare which parameters they reached, not how many or a sum of them.
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")

STEPS = 2
CHOSEN = {0: (0, 3), 1: (1, 2)}
DATA = torch.randn(8 * STEPS, 4, generator=torch.Generator().manual_seed(1))


def make_experts() -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    return tuple(nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(4)]) for _ in range(2))  # type: ignore[return-value]


def loss_of(experts: nn.ModuleList, x: torch.Tensor, rank: int) -> torch.Tensor:
    return sum(experts[i](x) for i in CHOSEN[rank]).pow(2).mean()  # type: ignore[union-attr]


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch on the global batch: each rank's loss on its shard, averaged as DDP does."""
    a, b = make_experts()
    optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.5)
    for step in range(STEPS):
        batch = DATA[8 * step : 8 * step + 8]
        loss = sum(loss_of(a, batch[r::2], r) + loss_of(b, batch[r::2], r) for r in range(2)) / 2
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
    return {f"a.{k}": v for k, v in a.state_dict().items()} | {f"b.{k}": v for k, v in b.state_dict().items()}


class Experts(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = make_experts()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        self.manual_backward(loss_of(self.a, batch, self.global_rank) + loss_of(self.b, batch, self.global_rank))
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), lr=0.5), torch.optim.SGD(self.b.parameters(), lr=0.5)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, DATA)


def main() -> None:
    out, stage_a, stage_b = sys.argv[1:]
    strategy = MultiDeepSpeedStrategy(
        stage=int(stage_a), engine_configs={"b": {"zero_optimization": {"stage": int(stage_b)}}}
    )
    trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(Experts())
    state = strategy.consolidated_state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.float().clone() for k, v in state.items()}, out)


if __name__ == "__main__":
    main()
    finish()
