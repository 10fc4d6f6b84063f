"""2 CPU ranks under MultiDeepSpeedStrategy give the same weights as one process of plain PyTorch."""

from __future__ import annotations

import math
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


CHECKPOINTED = [
    f"{pattern}+{mode}" for pattern in ("gan", "accumulate") for mode in ("reentrant", "non_reentrant", "hidden")
]

INTERRUPTED = ["interrupted+small_buckets"]  # ZeRO-2/3 reduce buckets during the backward that fails
VALIDATE_EVERY = 2  # run_patterns validates "+validated" patterns every 2 training steps


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda stage: f"zero{stage}")
def sgd_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-rank launch per stage: every pattern, and the GAN and accumulation with activation checkpointing."""
    tmp_path = tmp_path_factory.mktemp(f"zero{request.param}")
    return train(
        tmp_path, request.param, "sgd", 4, "32-true", *patterns.PATTERNS, *CHECKPOINTED, *INTERRUPTED, "gan+validated"
    )


def test_every_pattern_matches_pytorch_with_sgd(sgd_run: dict) -> None:
    for pattern in patterns.PATTERNS:
        result = sgd_run[pattern]
        assert result["automatic"] is False, "several optimizers must switch the module to manual optimization"
        assert set(result["engines"]) == {"generator", "discriminator"}
        assert_matches(result["weights"], patterns.reference(pattern, "sgd", 4), TOLERANCE)
        assert_backward_state_clean(result)


def test_activation_checkpointing_inside_engines_gives_the_same_weights(sgd_run: dict) -> None:
    """DeepSpeed's gradient hooks fire in several phases under checkpointing; the result must not change.

    ``+hidden`` puts each engine wholly inside a reentrant checkpoint: the engines are found only during
    the backward, when the checkpoint recomputes them.
    """
    for name in CHECKPOINTED:
        expected = patterns.reference(name.split("+")[0], "sgd", 4)  # plain modules, no checkpointing
        assert_matches(sgd_run[name]["weights"], expected, TOLERANCE)
        assert_backward_state_clean(sgd_run[name])


def test_training_goes_on_exactly_after_an_exception_in_backward_or_step(sgd_run: dict) -> None:
    """An error caught in the middle of a backward or of ``opt.step()`` (out of memory) leaves every engine clean.

    ``interrupted`` and ``step_interrupted`` (also in the test above) catch the error, clear the gradients and
    train on as in plain PyTorch; with small buckets, ZeRO-2/3 have reduced part of the gradients when it comes.
    """
    for name in ("interrupted", "step_interrupted", *INTERRUPTED):
        assert_matches(sgd_run[name]["weights"], patterns.reference(name.split("+")[0], "sgd", 4), TOLERANCE)
        assert_backward_state_clean(sgd_run[name])


def test_validation_during_fit_clears_gradients_as_lightning_does(sgd_run: dict) -> None:
    """Before validating during fit Lightning clears the module's gradients; the gan pattern leaves some on D."""
    result = sgd_run["gan+validated"]
    assert math.isfinite(result["val_loss"])
    expected = patterns.reference("gan", "sgd", 4, validate_every=VALIDATE_EVERY)
    assert_matches(result["weights"], expected, TOLERANCE)
    assert_backward_state_clean(result)


@pytest.mark.parametrize("stage", [1, 3])
def test_gan_with_adam_over_many_steps_matches_pytorch(tmp_path: Path, stage: int) -> None:
    steps = 12
    results = train(tmp_path, stage, "adam", steps, "32-true", "gan", "gan_toggle")
    for pattern in ("gan", "gan_toggle"):
        assert_matches(results[pattern]["weights"], patterns.reference(pattern, "adam", steps), TOLERANCE)
        assert_backward_state_clean(results[pattern])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_states_train_as_plain_pytorch(tmp_path: Path, stage: int) -> None:
    """``offload_optimizer`` on both engines: Adam steps on fp32 partitions in host memory, to PyTorch's weights."""
    steps = 6
    names = ("gan", "gan_zero_first", "zero_grad_unreached")  # the last: zero_grad() must also clear host buffers
    results = train(tmp_path, stage, "adam", steps, "32-true", *(f"{name}+offload" for name in names))
    for name in names:
        result = results[f"{name}+offload"]
        assert result["offloaded"] == {"generator": True, "discriminator": True}
        assert_matches(result["weights"], patterns.reference(name, "adam", steps), TOLERANCE)
        assert_backward_state_clean(result)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_offloaded_step_does_not_apply_the_last_steps_gradient_again(tmp_path: Path, stage: int) -> None:
    """``offload_optimizer``: a parameter reached at one step and not at the next stays put at the next (SGD)."""
    steps = 4
    result = train(tmp_path, stage, "sgd", steps, "32-true", "reach_alternates+offload")["reach_alternates+offload"]
    assert_matches(result["weights"], patterns.reference("reach_alternates", "sgd", steps), TOLERANCE)
    assert_backward_state_clean(result)


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


def test_cpu_training_when_deepspeed_chose_cuda(tmp_path: Path) -> None:
    """``Trainer(accelerator="cpu")`` on a GPU machine, where DeepSpeed picks CUDA by itself at import."""
    out = tmp_path / "weights.pt"
    run_ranks(RUNNER, str(out), "2", "sgd", "4", "32-true", "gan", env={"TEST_DEEPSPEED_CHOSE_CUDA": "1"})
    result = torch.load(out)["gan"]
    assert (result["device"], result["ds_accelerator"]) == ("cpu", "cpu")
    assert_matches(result["weights"], patterns.reference("gan", "sgd", 4), TOLERANCE)
