"""Losses that reach an engine (or some of its parameters) on some ranks only, and a reentrant checkpoint met
after a plain call of the same engine: 2 CPU ranks give plain PyTorch's weights on the global batch.

On 2 ranks, :func:`train_case` trains a ``tests.reach`` case under MultiDeepSpeedStrategy; each rank returns the
consolidated weights and the engines' backward state at the end of fit; the tests read rank 0's.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns, reach
from tests.distributed import run_experts
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks, run_ranks
from tests.distributed.run_patterns import backward_state
from tests.distributed.test_patterns import assert_backward_state_clean, assert_matches

TOLERANCE = 1e-5
STEPS = 6


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


def train_case(case: str, optimizer: str, steps: int, stage_g: int, stage_d: int, no_sync: bool) -> dict:
    """On each rank: fit ``case``; the consolidated weights and each engine's backward state at the end of fit."""
    module = ReachModule(case, optimizer, steps, no_sync)
    strategy = MultiDeepSpeedStrategy(
        stage=stage_g,
        engine_configs={"discriminator": {"zero_optimization": {"stage": stage_d}}},
    )
    at_end = AtFitEnd(lambda s: {name: backward_state(e) for name, e in s.engines.items()})
    trainer = cpu_trainer(strategy, callbacks=[at_end], enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(module)
    state = strategy.consolidated_state_dict()
    return {"weights": {k: v.float().clone() for k, v in state.items()}, "engines": at_end.value}


def train(case: str, optimizer: str, stage_g: int, stage_d: int, *flags: str) -> dict:
    return on_ranks(train_case, case, optimizer, STEPS, stage_g, stage_d, "no_sync" in flags, timeout=240)[0]


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


def test_ranks_reaching_as_many_parameters_but_other_ones_match_pytorch(tmp_path: Path) -> None:
    """Top-2 of 4 experts, {0, 3} on rank 0 and {1, 2} on rank 1, in a ZeRO-1 and a ZeRO-2 engine."""
    out = tmp_path / "weights.pt"
    run_ranks(Path(run_experts.__file__), str(out), "1", "2", timeout=240)
    trained, expected = torch.load(out), run_experts.reference()
    for key, value in expected.items():
        assert (trained[key] - value).abs().max().item() <= TOLERANCE, key
