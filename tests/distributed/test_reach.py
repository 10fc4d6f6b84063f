"""Losses that reach an engine (or some of its parameters) on some ranks only, and a reentrant checkpoint met
after a plain call of the same engine: 2 CPU ranks give plain PyTorch's weights on the global batch.

On 2 ranks, :func:`train_case` trains a ``tests.reach`` case under MultiDeepSpeedStrategy; each rank returns the
consolidated weights and the engines' backward state at the end of fit; the tests read rank 0's.

:func:`train_experts` trains two engines of 4 experts each, rank 0's loss using experts {0, 3}, rank 1's {1, 2}.
Each rank reaches as many parameters of each engine as the other, but not the same ones (top-2 routing that
differs per rank): the ranks must compare which parameters they reached, not how many or a sum of them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns, reach
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks
from tests.distributed.test_patterns import assert_backward_state_clean, assert_matches, backward_state

TOLERANCE = 1e-5
STEPS = 6
EXPERT_STEPS = 2
CHOSEN = {0: (0, 3), 1: (1, 2)}
EXPERT_DATA = torch.randn(8 * EXPERT_STEPS, 4, generator=torch.Generator().manual_seed(1))


class ReachModule(pl.LightningModule):
    def __init__(self, case: str, optimizer: str, steps: int, no_sync: bool) -> None:
        super().__init__()
        self.case, self.optimizer_name, self.steps, self.no_sync = case, optimizer, steps, no_sync
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        loss = reach.LOSSES[self.case](self.generator, self.discriminator, batch, self.global_rank, batch_idx)
        if self.no_sync:
            with self.trainer.strategy.no_sync():
                self.manual_backward(loss)
        else:
            self.manual_backward(loss)
        reach.train_step(self.case, self.generator, self.discriminator, loss, opt_g, opt_d, batch_idx)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            patterns.make_optimizer(self.optimizer_name, self.generator.parameters()),
            patterns.make_optimizer(self.optimizer_name, self.discriminator.parameters()),
        ]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(self.steps))


def train_case(
    case: str, optimizer: str, steps: int, stage_g: int, stage_d: int, no_sync: bool, find_unused: bool
) -> dict:
    """On each rank: fit ``case``; the consolidated weights and each engine's backward state at the end of fit."""
    module = ReachModule(case, optimizer, steps, no_sync)
    strategy = MultiDeepSpeedStrategy(
        stage=stage_g,
        engine_configs={"discriminator": {"zero_optimization": {"stage": stage_d}}},
        find_unused_parameters=find_unused,
    )
    at_end = AtFitEnd(lambda s: {name: backward_state(e) for name, e in s.engines.items()})
    trainer = cpu_trainer(strategy, callbacks=[at_end], enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(module)
    state = strategy.consolidated_state_dict()
    return {"weights": {k: v.float().clone() for k, v in state.items()}, "engines": at_end.value}


def train(case: str, optimizer: str, stage_g: int, stage_d: int, *flags: str) -> dict:
    """Fit ``case`` on 2 ranks; the uneven case with ``find_unused_parameters=True``, which it needs."""
    flag = "no_sync" in flags
    return on_ranks(train_case, case, optimizer, STEPS, stage_g, stage_d, flag, case == "uneven", timeout=240)[0]


def make_experts() -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    return tuple(nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(4)]) for _ in range(2))  # type: ignore[return-value]


def loss_of(experts: nn.ModuleList, x: torch.Tensor, rank: int) -> torch.Tensor:
    return sum(experts[i](x) for i in CHOSEN[rank]).pow(2).mean()  # type: ignore[union-attr]


def experts_reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch on the global batch: each rank's loss on its shard, averaged as DDP does."""
    a, b = make_experts()
    optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.5)
    for step in range(EXPERT_STEPS):
        batch = EXPERT_DATA[8 * step : 8 * step + 8]
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
        return sharded_loader(self, EXPERT_DATA)


def train_experts(stage_a: int, stage_b: int, find_unused: bool = True) -> dict[str, torch.Tensor]:
    """On each rank: fit :class:`Experts` with engine ``a`` at ZeRO-``stage_a``, ``b`` at ``stage_b``; the weights."""
    strategy = MultiDeepSpeedStrategy(
        stage=stage_a,
        engine_configs={"b": {"zero_optimization": {"stage": stage_b}}},
        find_unused_parameters=find_unused,
    )
    trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(Experts())
    state = strategy.consolidated_state_dict()
    return {k: v.float().clone() for k, v in state.items()}


@pytest.mark.parametrize(("stage_g", "stage_d"), [(0, 0), (1, 1), (2, 2), (0, 2), (2, 1)], ids=lambda s: f"zero{s}")
def test_loss_reaching_an_engine_on_some_ranks_matches_pytorch(stage_g: int, stage_d: int) -> None:
    """D on one rank per step (on none every third step); G's last layer on one rank or on both.

    Not at ZeRO-3: its backward gathers and reduces from its own hooks on the ranks that reach a submodule
    (README, limitations).
    """
    result = train("uneven", "sgd", stage_g, stage_d)
    assert_matches(result["weights"], reach.reference("uneven", "sgd", STEPS), TOLERANCE)
    assert_backward_state_clean({"engines": result["engines"]})


@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_reach_with_adam_matches_pytorch(stage: int) -> None:
    result = train("uneven", "adam", stage, 2)
    assert_matches(result["weights"], reach.reference("uneven", "adam", STEPS), TOLERANCE)


@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_reach_inside_no_sync_matches_pytorch(stage: int) -> None:
    result = train("uneven", "sgd", stage, stage, "no_sync")
    assert_matches(result["weights"], reach.reference("uneven", "sgd", STEPS), TOLERANCE)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plain_call_after_a_reentrant_checkpoint_of_the_same_engine(stage: int) -> None:
    """D(real) after checkpoint(D, G(z)): D's plain gradients arrive before the checkpoint's nested backward."""
    result = train("late_plain", "sgd", stage, stage)
    assert_matches(result["weights"], reach.reference("late_plain", "sgd", STEPS), TOLERANCE)
    assert_backward_state_clean({"engines": result["engines"]})


@pytest.mark.parametrize("stage", [2, 3])
def test_late_plain_call_inside_no_sync(stage: int) -> None:
    result = train("late_plain", "sgd", stage, stage, "no_sync")
    assert_matches(result["weights"], reach.reference("late_plain", "sgd", STEPS), TOLERANCE)


def test_ranks_reaching_as_many_parameters_but_other_ones_match_pytorch() -> None:
    """Top-2 of 4 experts, {0, 3} on rank 0 and {1, 2} on rank 1, in a ZeRO-1 and a ZeRO-2 engine."""
    trained, expected = on_ranks(train_experts, 1, 2, timeout=240)[0], experts_reference()
    for key, value in expected.items():
        assert (trained[key] - value).abs().max().item() <= TOLERANCE, key


def test_ranks_reaching_other_parameters_of_zero0_and_zero1_engines_need_no_agreement() -> None:
    """ZeRO-0/1 give unreached parameters zero gradients on each rank by themselves: the default step suffices."""
    trained, expected = on_ranks(train_experts, 1, 0, False, timeout=240)[0], experts_reference()
    for key, value in expected.items():
        assert (trained[key] - value).abs().max().item() <= TOLERANCE, key


def test_a_zero2_engine_reached_in_part_is_refused_without_find_unused_parameters() -> None:
    with pytest.raises(AssertionError, match=r"reached engine 'b' but not all of its trained parameters"):
        on_ranks(train_experts, 1, 2, False, timeout=240)


def test_an_engine_reached_on_some_ranks_fails_without_find_unused_parameters() -> None:
    """As DDP's default: the rank whose loss does not reach the engine refuses its step, naming the option."""
    with pytest.raises(AssertionError, match=r"find_unused_parameters=True"):
        on_ranks(train_case, "uneven", "sgd", STEPS, 0, 0, False, False, timeout=240)
