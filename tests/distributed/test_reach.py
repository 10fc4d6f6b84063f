"""Losses that reach an engine (or some of its parameters) on some ranks only, and a reentrant checkpoint met
after a plain call of the same engine: 2 CPU ranks give plain PyTorch's weights on the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import reach
from tests.distributed import run_experts
from tests.distributed.harness import run_ranks
from tests.distributed.test_patterns import assert_backward_state_clean, assert_matches

RUNNER = Path(__file__).with_name("run_reach.py")
TOLERANCE = 1e-5
STEPS = 6


def train(tmp_path: Path, case: str, optimizer: str, stage_g: int, stage_d: int, *flags: str) -> dict:
    out = tmp_path / "weights.pt"
    run_ranks(RUNNER, str(out), case, optimizer, str(STEPS), str(stage_g), str(stage_d), *flags, timeout=240)
    return torch.load(out)


@pytest.mark.parametrize(("stage_g", "stage_d"), [(0, 0), (1, 1), (2, 2), (0, 2), (2, 1)], ids=lambda s: f"zero{s}")
def test_loss_reaching_an_engine_on_some_ranks_matches_pytorch(tmp_path: Path, stage_g: int, stage_d: int) -> None:
    """D on one rank per step (on none every third step); G's last layer on one rank or on both.

    Not at ZeRO-3: its backward gathers and reduces from its own hooks on the ranks that reach a submodule
    (README, limitations).
    """
    result = train(tmp_path, "uneven", "sgd", stage_g, stage_d)
    assert_matches(result["weights"], reach.reference("uneven", "sgd", STEPS), TOLERANCE)
    assert_backward_state_clean({"engines": result["engines"]})


@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_reach_with_adam_matches_pytorch(tmp_path: Path, stage: int) -> None:
    result = train(tmp_path, "uneven", "adam", stage, 2)
    assert_matches(result["weights"], reach.reference("uneven", "adam", STEPS), TOLERANCE)


@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_reach_inside_no_sync_matches_pytorch(tmp_path: Path, stage: int) -> None:
    result = train(tmp_path, "uneven", "sgd", stage, stage, "no_sync")
    assert_matches(result["weights"], reach.reference("uneven", "sgd", STEPS), TOLERANCE)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plain_call_after_a_reentrant_checkpoint_of_the_same_engine(tmp_path: Path, stage: int) -> None:
    """D(real) after checkpoint(D, G(z)): D's plain gradients arrive before the checkpoint's nested backward."""
    result = train(tmp_path, "late_plain", "sgd", stage, stage)
    assert_matches(result["weights"], reach.reference("late_plain", "sgd", STEPS), TOLERANCE)
    assert_backward_state_clean({"engines": result["engines"]})


@pytest.mark.parametrize("stage", [2, 3])
def test_late_plain_call_inside_no_sync(tmp_path: Path, stage: int) -> None:
    result = train(tmp_path, "late_plain", "sgd", stage, stage, "no_sync")
    assert_matches(result["weights"], reach.reference("late_plain", "sgd", STEPS), TOLERANCE)


def test_ranks_reaching_as_many_parameters_but_other_ones_match_pytorch(tmp_path: Path) -> None:
    """Top-2 of 4 experts, {0, 3} on rank 0 and {1, 2} on rank 1, in a ZeRO-1 and a ZeRO-2 engine."""
    out = tmp_path / "weights.pt"
    run_ranks(RUNNER.with_name("run_experts.py"), str(out), "1", "2", timeout=240)
    trained, expected = torch.load(out), run_experts.reference()
    for key, value in expected.items():
        assert (trained[key] - value).abs().max().item() <= TOLERANCE, key
