"""Schedulers in manual optimization step when the user steps them, exactly as under Lightning's DDPStrategy.

The snippets of Lightning's manual-optimization guide: a scheduler stepped every step, every N epochs, a
ReduceLROnPlateau stepped with a logged metric, and a scheduler that is not a torch one. Each runs under
``DDPStrategy`` and under MultiDeepSpeedStrategy at ZeRO 0-3 on the same 2 ranks and data.

Each strategy (``ddp``, then MultiDeepSpeedStrategy at ZeRO 0-3) trains the same two-model module for 3
epochs with each way of stepping a scheduler; each rank returns the weights and learning rates per run
(the tests read rank 0's).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

MODES = ("every_step", "every_n_epochs", "plateau", "custom")
EPOCHS = 3


class Halving:
    """A scheduler that is not a torch one: halves every learning rate of its optimizer per ``step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Scheduled(pl.LightningModule):
    """Two regressors, one optimizer and one scheduler each, stepped the way ``mode`` says."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.second = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.made: list[Any] = []
        self.got_own_schedulers = True

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        x, y = batch[:, :4], batch[:, 4:]
        total = 0.0
        for module, opt in zip((self.first, self.second), self.optimizers(), strict=True):
            loss = (module(x) - y).pow(2).mean()
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            total += float(loss.detach())
        self.log("loss", total, on_epoch=True, on_step=False, sync_dist=True)
        schedulers = self.lr_schedulers()
        self.got_own_schedulers &= list(schedulers) == self.made
        every_second_epoch_ends = self.trainer.is_last_batch and (self.current_epoch + 1) % 2 == 0
        if self.mode in ("every_step", "custom") or (self.mode == "every_n_epochs" and every_second_epoch_ends):
            for sch in schedulers:
                sch.step()

    def on_train_epoch_end(self) -> None:
        if self.mode == "plateau":
            for sch in self.lr_schedulers():
                sch.step(self.trainer.callback_metrics["loss"])

    def configure_optimizers(self) -> Any:
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (self.first, self.second)]
        if self.mode == "every_step":
            self.made = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in optimizers]
        elif self.mode == "every_n_epochs":
            self.made = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
        elif self.mode == "plateau":  # an improvement must beat the best by 10: none does, so it halves each epoch
            self.made = [
                torch.optim.lr_scheduler.ReduceLROnPlateau(
                    o, factor=0.5, patience=0, threshold=10, threshold_mode="abs"
                )
                for o in optimizers
            ]
        else:
            self.made = [Halving(o) for o in optimizers]
        return optimizers, self.made

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step()  # only Lightning calls this (automatic optimization); here the user steps them

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(7)
        x = torch.randn(32, 4, generator=generator)
        data = torch.cat([x, x.sum(dim=1, keepdim=True).sin()], dim=1)
        return sharded_loader(self, data)


def strategy_for(name: str) -> pl.strategies.Strategy:
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=True)  # one backward per model
    return MultiDeepSpeedStrategy(stage=int(name.removeprefix("zero")))


def fit_each_run() -> dict[tuple[str, str], dict[str, Any]]:
    """On each rank: every strategy with every way of stepping; the weights and learning rates each ends with."""
    results = {}
    for name in ("ddp", "zero0", "zero1", "zero2", "zero3"):
        for mode in MODES:
            module = Scheduled(mode)
            trainer = cpu_trainer(
                strategy_for(name), max_epochs=EPOCHS, enable_checkpointing=False, use_distributed_sampler=False
            )
            trainer.fit(module)
            strategy = trainer.strategy
            state = strategy.consolidated_state_dict() if name != "ddp" else module.state_dict()
            results[(name, mode)] = {
                "weights": {k: v.detach().float().clone() for k, v in state.items()},
                "lr": [o.param_groups[0]["lr"] for o in trainer.optimizers],
                "own_schedulers": module.got_own_schedulers,
            }
    return results


TOLERANCE = 1e-5
STAGES = ("zero0", "zero1", "zero2", "zero3")
EXPECTED_LR = {  # lr 0.2; 3 epochs of 4 steps
    "every_step": 0.2 * 0.8**12,
    "every_n_epochs": 0.2 * 0.5,  # after epoch 2 of 3
    "plateau": 0.2 * 0.5**2,  # epochs 2 and 3 do not improve on epoch 1 by 10
    "custom": 0.2 * 0.5**12,
}


@pytest.fixture(scope="module")
def results() -> dict:
    return on_ranks(fit_each_run, timeout=600)[0]


@pytest.mark.parametrize("mode", MODES)
def test_ddp_steps_the_schedulers_as_the_guide_says(results: dict, mode: str) -> None:
    """The baseline itself: the learning rates DDP ends with are the ones the snippet asks for."""
    assert results[("ddp", mode)]["lr"] == [pytest.approx(EXPECTED_LR[mode])] * 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", STAGES)
def test_schedulers_step_as_under_ddp(results: dict, stage: str, mode: str) -> None:
    ours, ddp = results[(stage, mode)], results[("ddp", mode)]
    assert ours["own_schedulers"], "self.lr_schedulers() must return the objects from configure_optimizers"
    assert ours["lr"] == pytest.approx(ddp["lr"])
    assert ours["weights"].keys() == ddp["weights"].keys()
    for key, expected in ddp["weights"].items():
        diff = (ours["weights"][key] - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{stage}, {mode}: {key} differs from DDP by {diff:.2e}"
