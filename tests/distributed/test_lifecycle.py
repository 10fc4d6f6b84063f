"""Teardown leaves no hook behind, and the engines go at release: fit twice on one module, then test it.

ZeRO 0/2/3 and a frozen engine. After each fit its 3 stopped engines live on for ``trainer.save_checkpoint``
until ``strategy.release()`` or the next setup.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_multids._environment import ZERO_COLLECTIVES
from tests import patterns
from tests.distributed import run_lifecycle
from tests.distributed.harness import run_ranks
from tests.distributed.test_patterns import TOLERANCE, assert_matches

NOTHING_LEFT = {
    "module_hooks": 0,
    "param_hooks": 0,
    "optimizer_hooks": 0,
    "patched": [],
    "live_engines": 0,
    "warning_filters": 0,
    "extensions_dir": None,  # the ranks start without TORCH_EXTENSIONS_DIR, as a user's shell
    "gathered_check_group": False,  # destroyed at teardown
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lifecycle") / "results.pt"
    run_ranks(Path(run_lifecycle.__file__), str(out), timeout=300, env={"TORCH_EXTENSIONS_DIR": None})
    return torch.load(out)


@pytest.mark.parametrize("after", ["fit0", "fit1"])
def test_teardown_removes_every_hook_and_patch_and_keeps_the_stopped_engines(results: dict, after: str) -> None:
    assert results["before"] == NOTHING_LEFT
    assert results[after] == {**NOTHING_LEFT, "live_engines": 3}
    assert results[f"{after}_engines"] == ["critic", "discriminator", "generator"]


@pytest.mark.parametrize("after", ["released", "test", "failed", "failed_before_setup"])
def test_release_or_the_next_setup_frees_the_engines(results: dict, after: str) -> None:
    assert results[after] == NOTHING_LEFT


@pytest.mark.parametrize("fit", ["fit0", "fit1"])
def test_deepspeeds_ops_are_built_in_the_environment_during_fit(results: dict, fit: str) -> None:
    """Without ``TORCH_EXTENSIONS_DIR``, the strategy's start sets it (import does not), and teardown unsets it."""
    assert results[f"{fit}_extensions_in_fit"] == results["default_extensions_dir"]


@pytest.mark.parametrize("fit", ["fit0", "fit1"])
def test_zero_deprecations_are_hidden_during_fit_where_torch_has_them(results: dict, fit: str) -> None:
    """torch 2.13/2.14 deprecate the collectives DeepSpeed's ZeRO calls; the filter lives only while engines do."""
    deprecated = any(hasattr(getattr(torch.distributed, n), "__deprecated__") for n in ZERO_COLLECTIVES)
    assert results[f"{fit}_filters_in_fit"] == int(deprecated)


def test_a_second_fit_on_the_same_module_trains_on_from_the_first(results: dict) -> None:
    """Each fit builds new engines on the weights the last one left (ZeRO-3 ones still partitioned)."""
    expected = patterns.reference("gan", "sgd", run_lifecycle.STEPS, fits=2)
    assert_matches(results["weights"], expected, TOLERANCE)


def test_test_after_fit_runs_the_trained_zero3_engine(results: dict) -> None:
    expected = patterns.reference("gan", "sgd", run_lifecycle.STEPS, fits=2)
    G, D = patterns.make_modules()
    G.load_state_dict({k.removeprefix("generator."): v for k, v in expected.items() if k.startswith("generator.")})
    D.load_state_dict(
        {k.removeprefix("discriminator."): v for k, v in expected.items() if k.startswith("discriminator.")}
    )
    _, z = patterns.split(results["test_inputs"])
    with torch.no_grad():
        diff = (D(G(z)) - results["test_outputs"]).abs().max().item()
    assert diff <= TOLERANCE


def test_saving_after_release_is_refused_with_the_fix(results: dict) -> None:
    """The engines that write each part of a checkpoint are gone after ``release()``: say where to save instead."""
    assert results["released_engines"] == [] and results["released_optimizers"] == 0
    assert "strategy.release()" in results["save_after_release"]
    assert "ModelCheckpoint" in results["save_after_release"]


def test_saving_after_a_failed_fit_is_refused(results: dict) -> None:
    """A fit that ended in an exception does not keep its engines: they may be between a backward and a step."""
    assert "ended in an exception" in results["save_after_failure"]
    assert "ended in an exception" in results["save_after_failure_before_setup"]  # the earlier fit's too


def test_test_after_a_bf16_fit_runs(results: dict) -> None:
    """The bf16 engines' whole submodules lose their input cast at teardown: they go back to fp32 instead."""
    assert results["bf16_generator_dtype"] == "torch.float32"
    outputs = results["bf16_test_outputs"]
    assert outputs.shape == results["test_outputs"].shape and torch.isfinite(outputs).all()
