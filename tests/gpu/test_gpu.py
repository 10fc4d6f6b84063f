"""The equivalence suite on one GPU: one process, nccl, the same rank code as the 2-rank CPU suite.

Run with ``make test-gpu``; skipped with "no CUDA" where there is none. With nccl, Lightning evaluates
under ``torch.inference_mode`` (with gloo under ``no_grad``), and autograd runs a CUDA backward on its own
device thread: both differ from the CPU suite.

``GPU_SUITE_ON_CPU=1`` runs the same tests as one CPU process over gloo (fp16 excepted), to check the
suite itself on a machine without a GPU.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import patterns
from tests.distributed import (
    test_checkpoint,
    test_ema,
    test_frozen,
    test_gathered,
    test_gradcache,
    test_patterns,
    test_weights_only,
)
from tests.distributed.harness import on_ranks
from tests.distributed.test_examples import SHORT, events, lightning_multids, workdir  # noqa: F401 (fixture)
from tests.distributed.test_patterns import (
    CHECKPOINTED,
    TOLERANCE,
    VALIDATE_EVERY,
    assert_backward_state_clean,
    assert_matches,
)

ON_CPU = os.environ.get("GPU_SUITE_ON_CPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() and not ON_CPU, reason="no CUDA: the GPU suite needs a CUDA device"
    ),
]

ACCELERATOR = "cpu" if ON_CPU else "gpu"
ONE_GPU = {"TEST_ACCELERATOR": ACCELERATOR}
GPU_CLI = [f"--trainer.accelerator={ACCELERATOR}", "--trainer.devices=1"]
DEVICE = ("cpu", "cpu") if ON_CPU else ("cuda:0", "cuda")
FP16 = pytest.mark.skipif(ON_CPU, reason="fp16 does not run on CPU")


def on_gpu(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, a test module's rank code, in one process on the GPU; what it returned."""
    return on_ranks(function, *args, world_size=1, env=ONE_GPU, timeout=600)[0]


def train(stage: int, optimizer: str, steps: int, precision: str, *names: str) -> dict:
    return on_gpu(test_patterns.fit_patterns, stage, optimizer, steps, precision, list(names))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gan_patterns_match_pytorch(stage: int) -> None:
    results = train(stage, "sgd", 4, "32-true", *patterns.PATTERNS, *CHECKPOINTED)
    for name, result in results.items():
        assert (result["device"], result["ds_accelerator"]) == DEVICE
        assert result["weight_devices"] == ["cpu"], "after fit the module's weights are on the CPU, as under DDP"
        assert_matches(result["weights"], patterns.reference(name.split("+")[0], "sgd", 4), TOLERANCE)
        assert_backward_state_clean(result)


def test_gan_with_adam_at_zero3_matches_pytorch() -> None:
    results = train(3, "adam", 12, "32-true", "gan", "gan_toggle")
    for pattern, result in results.items():
        assert_matches(result["weights"], patterns.reference(pattern, "adam", 12), TOLERANCE)


def test_bf16_gan_trains_close_to_fp32() -> None:
    result = train(2, "sgd", 4, "bf16-mixed", "gan")["gan"]
    assert result["dtype"] == "torch.bfloat16"
    assert_matches(result["weights"], patterns.reference("gan", "sgd", 4), 3e-2)


@FP16
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_engines_at_different_loss_scales_share_one_loss(stage: int) -> None:
    """One loss through the generator (scale 2^8) and the discriminator (2^4): each steps at its own scale."""
    result = train(stage, "sgd", 4, "16-mixed", "shared")["shared"]
    assert result["dtype"] == "torch.float16"
    if stage > 0:  # ZeRO optimizers expose their scale; no overflow, so the initial scales hold
        assert result["loss_scales"] == {"generator": 2.0**8, "discriminator": 2.0**4}
    # fp16 keeps ~3 significant digits: compare with the fp32 reference at that resolution.
    assert_matches(result["weights"], patterns.reference("shared", "sgd", 4), 3e-2)


def test_validation_during_fit_at_zero3_leaves_training_equal() -> None:
    """Lightning validates under inference_mode with nccl; ZeRO-3 gathers inside it, then training goes on."""
    result = train(3, "sgd", 4, "32-true", "gan+validated")["gan+validated"]
    assert math.isfinite(result["val_loss"])
    assert_matches(result["weights"], patterns.reference("gan", "sgd", 4, validate_every=VALIDATE_EVERY), TOLERANCE)


def test_distillation_with_a_zero3_teacher_matches_pytorch() -> None:
    specs = ["distill:3:1", "distill:3:2", "distill:3:3"]
    results = on_gpu(test_frozen.fit_specs, test_frozen.STEPS, "32-true", specs)
    for spec in specs:
        test_frozen.assert_matches_reference(results[spec], "distill")


@pytest.mark.parametrize("stage", [2, 3])
def test_grad_cache_equals_full_batch_pytorch(stage: int) -> None:
    cases = on_gpu(test_gradcache.fit_cases, stage)
    test_gradcache.assert_matches(cases["two"]["weights"], test_gradcache.reference(shared=False))
    test_gradcache.assert_matches(cases["shared"]["weights"], test_gradcache.reference(shared=True))


def test_resume_is_bitwise_exact(tmp_path: Path) -> None:
    results = on_gpu(test_checkpoint.resume_runs, tmp_path, "gan", [0, 2, 3])
    test_checkpoint.assert_resumed_exactly(results, "gan, one process")


def test_save_checkpoint_after_fit_resumes_bitwise_exactly(tmp_path: Path) -> None:
    """After fit the module is on the CPU and Adam's moments in host memory (Lightning's teardown moves both),
    while the stopped engines' fp32 partitions stay on the GPU."""
    options = test_checkpoint.ResumeOptions(after_fit=True, bf16=True)
    results = on_gpu(test_checkpoint.resume_runs, tmp_path, "gan", [0, 2, 3], options)
    test_checkpoint.assert_resumed_exactly(results, "gan after fit, one process")


def test_ema_matches_pytorch(tmp_path: Path) -> None:
    """A ZeRO-3 average of a ZeRO-2 generator, and of a ZeRO-3 one resumed: plain PyTorch's ``AveragedModel``."""
    specs = ["2:3", "3p0:3p0:resumed"]
    results = on_gpu(test_ema.fit_all, test_ema.DECAY, specs, tmp_path)
    for spec in specs:
        test_ema.test_average_matches_plain_pytorch(results, spec)


def test_gathered_blocks_at_zero3_match_pytorch() -> None:
    """``strategy.gathered`` on a trained and a frozen ZeRO-3 engine: whole inside, training after it exact."""
    results = [on_gpu(test_gathered.fit, test_gathered.STEPS)]
    test_gathered.test_inside_the_block_the_submodule_is_whole_and_gives_the_same_outputs(results)
    test_gathered.test_training_after_the_blocks_matches_plain_pytorch(results)
    test_gathered.test_misuse_is_refused_and_an_exception_leaves_it_usable(results)


def train_and_load(root: Path) -> dict[str, str]:
    """One process: a distillation saved, then resumed from a clean copy and from one with poisoned model states."""
    test_weights_only.train(root)
    shutil.copytree(root / "ckpts" / "last.ckpt", root / "cases" / "clean" / "last.ckpt")
    test_weights_only.poisoned_copy(root, "poisoned", test_weights_only.PARTS["model_states"])
    return test_weights_only.load_cases(root, ["clean:true:fit", "poisoned:none:fit"])


def test_weights_only_resume_loads_tensors_and_refuses_code(tmp_path: Path) -> None:
    results = on_gpu(train_and_load, tmp_path)
    assert results["clean"] == "ok", results["clean"]
    assert results["poisoned"].startswith("UnpicklingError: Refusing to load"), results["poisoned"]
    assert not (tmp_path / "cases" / "poisoned.ran").exists(), "the poisoned model states ran code"


@pytest.mark.parametrize(
    "precision", ["bf16-mixed", pytest.param("16-mixed", marks=pytest.mark.skipif(ON_CPU, reason="fp16"))]
)
def test_gan_config_trains_through_the_cli(workdir: Path, precision: str) -> None:  # noqa: F811
    lightning_multids(
        workdir, "fit", "--config", "configs/gan.yaml", *SHORT, *GPU_CLI, f"--trainer.precision={precision}"
    )
    tags = events(workdir / "outputs" / "gan" / "gan" / "version_0").Tags()
    assert {"train/d_loss", "train/g_loss", "val/kid"} <= set(tags["scalars"]), tags["scalars"]


def test_distillation_configs_train_through_the_cli(workdir: Path) -> None:  # noqa: F811
    lightning_multids(workdir, "fit", "--config", "configs/distill_teacher.yaml", *SHORT, *GPU_CLI)
    output = lightning_multids(workdir, "fit", "--config", "configs/distill.yaml", *SHORT, *GPU_CLI)
    assert "Engines (ZeRO stage): {'student': 2, 'teacher': 3}" in output
    tags = events(workdir / "outputs" / "distill" / "distilled" / "version_0").Tags()["scalars"]
    assert {"train/loss", "val/accuracy", "val/teacher_accuracy"} <= set(tags), tags


def test_frozen_teacher_reaches_the_gpu_only_after_its_cast() -> None:
    """A 48 MiB (fp32) teacher built in ``__init__``, bf16: setup never holds it on the device in fp32."""
    result = on_gpu(test_frozen.move_teachers)
    test_frozen.assert_moved_in_bf16(result)
    if not ON_CPU:
        for stage in (2, 3):
            peak = result[stage]["setup_peak"]
            assert peak < 0.75 * result["teacher_fp32_bytes"], f"ZeRO-{stage}: setup peaked at {peak / 2**20:.0f} MiB"
