"""Submodules built in ``configure_model`` under ZeRO-3: each engine's config, tied weights, a fresh-process test."""

from __future__ import annotations

from pathlib import Path

import torch

from tests import patterns
from tests.distributed import run_configure_model as case
from tests.distributed.harness import run_ranks
from tests.distributed.test_patterns import TOLERANCE


def run(out: Path, name: str) -> dict:
    run_ranks(Path(case.__file__), str(out), name, timeout=300)
    return torch.load(out)


def test_zero3_from_the_strategy_config_builds_partitioned(tmp_path: Path) -> None:
    """``MultiDeepSpeedStrategy(stage=2, config={"zero_optimization": {"stage": 3}})``: the config's stage wins."""
    result = run(tmp_path / "out.pt", "config_stage")
    assert result["built_partitioned"] == {"teacher": True, "student": True}
    assert result["stages"] == {"student": 3}


def test_zero_init_gets_the_zero3_engine_own_config(tmp_path: Path) -> None:
    """The teacher's own entry asks for bf16: its partitions are created in bf16, beside an fp32 student."""
    result = run(tmp_path / "out.pt", "own_dtype")
    assert result["teacher_dtype"] == "torch.bfloat16"
    assert result["stages"] == {"student": 2, "teacher": 3}


def test_tied_weights_stay_tied_when_made_whole(tmp_path: Path) -> None:
    """A ZeRO-2 student built under zero.Init is made whole at setup; its two tied layers stay one parameter."""
    result = run(tmp_path / "out.pt", "tied")
    assert result["tied_in_training"]
    weights = result["weights"]
    assert torch.equal(weights["student.0.weight"], weights["student.2.weight"])


def test_test_from_a_checkpoint_in_a_fresh_process_at_zero3(tmp_path: Path) -> None:
    """Fit (ZeRO-3 teacher and student) saves; a new process builds them partitioned and tests the checkpoint."""
    out = tmp_path / "out.pt"
    fitted = run(out, "fit")
    tested = run(out, "test")
    assert tested["built_partitioned"] == {"teacher": True, "student": True}
    teacher, student = patterns.make_distill_modules()
    teacher.load_state_dict({k.removeprefix("teacher."): v for k, v in fitted["weights"].items() if "teacher." in k})
    student.load_state_dict({k.removeprefix("student."): v for k, v in fitted["weights"].items() if "student." in k})
    teacher.eval()
    head = torch.nn.Linear(4, 4)  # the plain submodule, saved at 0.5 everywhere, built partitioned in the new process
    torch.nn.init.constant_(head.weight, 0.5)
    torch.nn.init.constant_(head.bias, 0.5)
    with torch.no_grad():
        trained = student(tested["inputs"])
        expected = torch.cat([teacher(tested["inputs"]), trained, head(trained)], dim=1)
    initial = patterns.make_distill_modules()[1](tested["inputs"])
    assert (expected[:, 4:8] - initial).abs().max().item() > 1e-3, "the student barely trained: the test would be weak"
    assert (tested["outputs"] - expected).abs().max().item() <= TOLERANCE
