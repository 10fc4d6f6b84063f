"""Teardown leaves no hook behind, and the engines go at release: fit twice on one module, then test it.

ZeRO 0/2/3 and a frozen engine. After each fit its 3 stopped engines live on for ``trainer.save_checkpoint``
until ``strategy.release()`` or the next setup.

The rank code, :func:`fit_fit_test`, run on 2 ranks: the module has a generator (ZeRO-0 in the first fit, ZeRO-2
in the second), a ZeRO-3 discriminator and a frozen ZeRO-3 critic, so every kind of hook the strategy and DeepSpeed
register is there during fit: a step pre-hook on the user's optimizer (stage 0), gradient hooks (every stage,
ZeRO-2's after accumulation), ZeRO-3's module hooks, the input cast pre-hook and the frozen engine's ``train``
patch. Rank 0 returns, after each fit, after ``strategy.release()`` and after the test, the hooks and live engines
it counts. A fit keeps its stopped engines for ``trainer.save_checkpoint`` until the next setup (the test's, on the
same trainer) or ``release()``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import deepspeed
import lightning.pytorch as pl
import pytest
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._environment import EXTENSIONS_VARIABLE, default_extensions_dir
from lightning_multids._noise import ZERO_COLLECTIVES, ZERO_DEPRECATIONS
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks
from tests.distributed.test_patterns import TOLERANCE, assert_matches

STEPS = 4
BUILD_SHM_OP = importlib.import_module("deepspeed.comm.torch").build_shm_op  # before any fit replaces it


class Lifecycle(pl.LightningModule):
    """The gan pattern, with a frozen critic called under no_grad in every step and in test."""

    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = patterns.make_modules()
        self.critic = nn.Linear(6, 1)
        self.made: list[torch.optim.Optimizer] = []
        self.test_inputs: list[torch.Tensor] = []
        self.test_outputs: list[torch.Tensor] = []
        self.filters_in_fit = 0
        self.extensions_in_fit: str | None = None
        self.inference_op_built: bool | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.filters_in_fit = zero_deprecation_filters()
        self.extensions_in_fit = os.environ.get(EXTENSIONS_VARIABLE)
        self.inference_op_built = deepspeed.comm.comm.cdb.shm_comm_op is not None
        opt_g, opt_d = self.optimizers()
        patterns.gan(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)
        with torch.no_grad():
            self.critic(patterns.split(batch)[0])

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, z = patterns.split(batch)
        self.critic(real)
        self.test_inputs.append(batch.clone())
        self.test_outputs.append(self.discriminator(self.generator(z)).float().clone())

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        self.made = [patterns.make_optimizer("sgd", m.parameters()) for m in (self.generator, self.discriminator)]
        return self.made

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


class FailsInFit(Lifecycle):
    """Raises in its second training step, on every rank."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if batch_idx == 1:
            raise ValueError("the user's error")
        super().training_step(batch, batch_idx)


class FailsAtSetup(Lifecycle):
    """Raises in its ``setup`` hook, before the strategy's setup would release an earlier fit's engines."""

    def setup(self, stage: str) -> None:
        raise ValueError("the user's data is missing")


def zero_deprecation_filters() -> int:
    """The warning filters that hide torch's deprecations of DeepSpeed's ZeRO collectives."""
    return sum(f[1] is not None and f[1].pattern == ZERO_DEPRECATIONS for f in warnings.filters)


def leftovers(module: Lifecycle) -> dict[str, Any]:
    """What the strategy or DeepSpeed may have left on the module, its optimizers and in memory."""
    gc.collect()
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return {
        "module_hooks": sum(len(getattr(m, h)) for m in module.modules() for h in hooks),
        "param_hooks": sum(
            len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
            for p in module.parameters()
        ),
        "optimizer_hooks": sum(len(o._optimizer_step_pre_hooks) for o in module.made),
        "zero3_functions": sum(name in m.__dict__ for m in module.modules() for name in ("pre_bwd_fn", "post_bwd_fn")),
        "patched": sorted(n for n, m in module.named_children() if "train" in m.__dict__),
        "live_engines": sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects()),
        "warning_filters": zero_deprecation_filters(),
        "extensions_dir": os.environ.get(EXTENSIONS_VARIABLE),
        "shm_op_builder_is_deepspeeds": importlib.import_module("deepspeed.comm.torch").build_shm_op is BUILD_SHM_OP,
        "gathered_check_group": module._trainer is not None and module.trainer.strategy._arrival is not None,
    }


def strategy(generator_stage: int) -> MultiDeepSpeedStrategy:
    return MultiDeepSpeedStrategy(
        engine_configs={
            "generator": {"zero_optimization": {"stage": generator_stage}},
            "discriminator": {"zero_optimization": {"stage": 3}},
            "critic": {"zero_optimization": {"stage": 3}},
        }
    )


def fit_fit_test(out: Path) -> dict[str, Any] | None:
    """On each rank: the fits and tests above; rank 0 returns what it counted, the other None."""
    module = Lifecycle()
    results: dict[str, Any] = {"before": leftovers(module), "default_extensions_dir": str(default_extensions_dir())}
    for fit, stage in enumerate((0, 2)):
        trainer = cpu_trainer(strategy(stage), enable_checkpointing=False, use_distributed_sampler=False)
        trainer.fit(module)
        results[f"fit{fit}"] = leftovers(module)
        results[f"fit{fit}_engines"] = sorted(trainer.strategy.engines)
        results[f"fit{fit}_filters_in_fit"] = module.filters_in_fit
        results[f"fit{fit}_extensions_in_fit"] = module.extensions_in_fit
        results[f"fit{fit}_inference_op_built"] = module.inference_op_built
        if fit == 0:
            trainer.strategy.release()
            results["released"] = leftovers(module)
            results["released_engines"] = sorted(trainer.strategy.engines)
            results["released_optimizers"] = len(trainer.strategy.optimizers)
            try:
                trainer.save_checkpoint(out / "after_release.ckpt")
            except RuntimeError as error:
                results["save_after_release"] = str(error)
    results["weights"] = {k: v.float().clone() for k, v in trainer.strategy.consolidated_state_dict().items()}
    trainer.test(module)  # its setup releases the fit's engines; its teardown, the test's
    results["test"] = leftovers(module)
    results["test_inputs"] = torch.cat(module.test_inputs)
    results["test_outputs"] = torch.cat(module.test_outputs)
    # bf16: whole submodules go back to fp32 at teardown (no input cast any more); ZeRO-3 ones get engines again
    half = Lifecycle()
    cpu_trainer(strategy(2), precision="bf16-mixed", enable_checkpointing=False, use_distributed_sampler=False).fit(
        half
    )
    results["bf16_generator_dtype"] = str(next(half.generator.parameters()).dtype)
    cpu_trainer(strategy(2), precision="bf16-mixed", use_distributed_sampler=False).test(half)
    results["bf16_test_outputs"] = torch.cat(half.test_outputs)
    # a fit that ends in an exception keeps nothing: its engines may be mid-step
    failing = FailsInFit()
    failed = cpu_trainer(strategy(2), enable_checkpointing=False, use_distributed_sampler=False)
    with contextlib.suppress(ValueError):
        failed.fit(failing)
    results["failed"] = leftovers(failing)
    try:
        failed.save_checkpoint(out / "after_failure.ckpt")
    except RuntimeError as error:
        results["save_after_failure"] = str(error)
    # a fit whose ZeRO-3 engine runs out of memory inside `deepspeed.initialize`, after its hooks are on the module:
    # those come off, and so does the engine built before it
    unbuilt = Lifecycle()
    with (
        mock.patch.object(Stage3, "_setup_for_real_optimizer", side_effect=MemoryError("no memory left")),
        contextlib.suppress(MemoryError),
    ):
        cpu_trainer(strategy(2), enable_checkpointing=False, use_distributed_sampler=False).fit(unbuilt)
    results["failed_while_building"] = leftovers(unbuilt)
    # a fit that fails before its setup: the earlier fit's engines (of another module) go too
    failed.fit(Lifecycle())
    with contextlib.suppress(ValueError):
        failed.fit(FailsAtSetup())
    results["failed_before_setup"] = leftovers(failing)
    try:
        failed.save_checkpoint(out / "after_failure_before_setup.ckpt")
    except RuntimeError as error:
        results["save_after_failure_before_setup"] = str(error)
    return results if trainer.global_rank == 0 else None


NOTHING_LEFT = {
    "module_hooks": 0,
    "param_hooks": 0,
    "optimizer_hooks": 0,
    "zero3_functions": 0,  # bound to this fit's engines: the next fit's make their own
    "patched": [],
    "live_engines": 0,
    "warning_filters": 0,
    "extensions_dir": None,  # the ranks start without TORCH_EXTENSIONS_DIR, as a user's shell
    "shm_op_builder_is_deepspeeds": True,  # put back after the comm layer started
    "gathered_check_group": False,  # destroyed at teardown
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lifecycle")
    counted = on_ranks(fit_fit_test, out, timeout=300, env={"TORCH_EXTENSIONS_DIR": None})[0]
    assert counted is not None
    return counted


@pytest.mark.parametrize("after", ["fit0", "fit1"])
def test_teardown_removes_every_hook_and_patch_and_keeps_the_stopped_engines(results: dict, after: str) -> None:
    assert results["before"] == NOTHING_LEFT
    assert results[after] == {**NOTHING_LEFT, "live_engines": 3}
    assert results[f"{after}_engines"] == ["critic", "discriminator", "generator"]


@pytest.mark.parametrize("after", ["released", "test", "failed", "failed_while_building", "failed_before_setup"])
def test_release_or_the_next_setup_frees_the_engines(results: dict, after: str) -> None:
    assert results[after] == NOTHING_LEFT


@pytest.mark.parametrize("fit", ["fit0", "fit1"])
def test_deepspeeds_ops_are_built_in_the_environment_during_fit(results: dict, fit: str) -> None:
    """Without ``TORCH_EXTENSIONS_DIR``, the strategy's start sets it (import does not), and teardown unsets it."""
    assert results[f"{fit}_extensions_in_fit"] == results["default_extensions_dir"]


def test_deepspeeds_cpu_op_for_inference_only_is_not_built(results: dict) -> None:
    """DeepSpeed's comm layer compiles a shared-memory op on CPU (30-70 s) that only inference all-reduces use."""
    assert results["fit0_inference_op_built"] is False


@pytest.mark.parametrize("fit", ["fit0", "fit1"])
def test_zero_deprecations_are_hidden_during_fit_where_torch_has_them(results: dict, fit: str) -> None:
    """torch 2.13/2.14 deprecate the collectives DeepSpeed's ZeRO calls; the filter lives only while engines do."""
    deprecated = any(hasattr(getattr(torch.distributed, n), "__deprecated__") for n in ZERO_COLLECTIVES)
    assert results[f"{fit}_filters_in_fit"] == int(deprecated)


def test_a_second_fit_on_the_same_module_trains_on_from_the_first(results: dict) -> None:
    """Each fit builds new engines on the weights the last one left (ZeRO-3 ones still partitioned)."""
    expected = patterns.reference("gan", "sgd", STEPS, fits=2)
    assert_matches(results["weights"], expected, TOLERANCE)


def test_test_after_fit_runs_the_trained_zero3_engine(results: dict) -> None:
    expected = patterns.reference("gan", "sgd", STEPS, fits=2)
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
