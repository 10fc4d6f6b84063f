"""2 CPU ranks under MultiDeepSpeedStrategy give the same weights as one process of plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import patterns
from tests.distributed.harness import run_ranks

RUNNER = Path(__file__).with_name("run_patterns.py")
TOLERANCE = 1e-5
MIN_MOVE = 1e-2


def train(tmp_path: Path, stage: int, optimizer: str, steps: int, precision: str, *names: str) -> dict:
    out = tmp_path / "weights.pt"
    run_ranks(RUNNER, str(out), str(stage), optimizer, str(steps), precision, *names)
    return torch.load(out)


def assert_matches(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float) -> None:
    initial = patterns.weights(*patterns.make_modules())
    assert trained.keys() >= expected.keys()
    for engine in ("generator", "discriminator"):
        keys = [k for k in expected if k.startswith(engine)]
        if not keys:
            continue
        moved = max((expected[k] - initial[k]).abs().max().item() for k in keys)
        assert moved >= MIN_MOVE, f"{engine} barely trained in the reference ({moved:.1e}): the test would be weak"
        for key in keys:
            diff = (trained[key] - expected[key]).abs().max().item()
            assert diff <= tolerance, f"{key}: max abs difference {diff:.2e} from plain PyTorch"


def assert_backward_state_clean(result: dict) -> None:
    for name, state in result["engines"].items():
        assert state == {k: 0 for k in state}, f"engine {name!r} left DeepSpeed state behind: {state}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_pattern_matches_pytorch_with_sgd(tmp_path: Path, stage: int) -> None:
    results = train(tmp_path, stage, "sgd", 4, "32-true", *patterns.PATTERNS)
    for pattern in patterns.PATTERNS:
        result = results[pattern]
        assert result["automatic"] is False, "several optimizers must switch the module to manual optimization"
        assert set(result["engines"]) == {"generator", "discriminator"}
        assert_matches(result["weights"], patterns.reference(pattern, "sgd", 4), TOLERANCE)
        assert_backward_state_clean(result)


@pytest.mark.parametrize("stage", [1, 3])
def test_gan_with_adam_over_many_steps_matches_pytorch(tmp_path: Path, stage: int) -> None:
    steps = 12
    results = train(tmp_path, stage, "adam", steps, "32-true", "gan", "gan_toggle")
    for pattern in ("gan", "gan_toggle"):
        assert_matches(results[pattern]["weights"], patterns.reference(pattern, "adam", steps), TOLERANCE)
        assert_backward_state_clean(results[pattern])


def test_single_optimizer_automatic_optimization_matches_pytorch(tmp_path: Path) -> None:
    steps = 6
    result = train(tmp_path, 2, "sgd", steps, "32-true", "automatic")["automatic"]
    assert result["automatic"] is True
    assert_matches(result["weights"], patterns.reference_automatic(steps), TOLERANCE)
    # StepLR(gamma=0.5) stepped by Lightning once per optimizer step: 3 steps of 0.2.
    assert result["lr"] == [pytest.approx(0.2 * 0.5**3)]


def test_bf16_gan_trains_close_to_fp32(tmp_path: Path) -> None:
    result = train(tmp_path, 2, "sgd", 4, "bf16-mixed", "gan")["gan"]
    assert result["dtype"] == "torch.bfloat16"
    # bf16 keeps ~3 significant digits: compare with the fp32 reference at that resolution.
    assert_matches(result["weights"], patterns.reference("gan", "sgd", 4), 3e-2)


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_inside_engines_gives_the_same_weights(tmp_path: Path, checkpoint: str) -> None:
    """DeepSpeed's gradient hooks fire in several phases under checkpointing; the result must not change."""
    for stage in (1, 2, 3):
        names = [f"{pattern}+{checkpoint}" for pattern in ("gan", "accumulate")]
        results = train(tmp_path, stage, "sgd", 4, "32-true", *names)
        for name in names:
            expected = patterns.reference(name.split("+")[0], "sgd", 4)  # plain modules, no checkpointing
            assert_matches(results[name]["weights"], expected, TOLERANCE)
            assert_backward_state_clean(results[name])
