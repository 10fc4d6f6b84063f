"""2 CPU ranks under MultiDeepSpeedStrategy give the same weights as one process of plain PyTorch.

The rank code, :func:`fit_patterns`, trains the GAN patterns of ``tests.patterns`` (each one fit) and returns the
weights and the engines' state at the end of each. The GPU suite runs it too, on one GPU, and test_reliability on
2 nodes.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

TOLERANCE = 1e-5
MIN_MOVE = 1e-2


class PatternModule(pl.LightningModule):
    """A GAN-shaped module whose training_step is one of ``patterns.STEPS``; no manual flag set."""

    def __init__(self, pattern: str, optimizer: str, steps: int) -> None:
        super().__init__()
        # "gan+reentrant": the gan pattern with activation checkpointing inside both engines;
        # "gan+validated": the gan pattern with a validation run every 2 training steps;
        # "gan+small_buckets": ZeRO-2/3 reduce during the backward, bucket after bucket (see SMALL_BUCKETS)
        self.pattern, _, variant = pattern.partition("+")
        self.optimizer_name, self.steps = optimizer, steps
        self.validated = variant == "validated"
        checkpoint = variant if variant in ("reentrant", "non_reentrant", "hidden") else None
        self.generator, self.discriminator = patterns.make_modules(checkpoint=checkpoint)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        toggle = self.toggled_optimizer if self.pattern == "gan_toggle" else None
        extra = {"clip": self.clip} if self.pattern in patterns.CLIPPING else {}
        patterns.STEPS[self.pattern](
            self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward, toggle, **extra
        )

    def clip(self, optimizer: object, max_norm: float) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            patterns.make_optimizer(self.optimizer_name, self.generator.parameters()),
            patterns.make_optimizer(self.optimizer_name, self.discriminator.parameters()),
        ]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = patterns.make_batches(self.steps)
        return sharded_loader(self, data)


class ValidatedModule(PatternModule):
    """A pattern module that Lightning also validates during fit (every 2 training steps, see :func:`fit_patterns`)."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, z = patterns.split(batch)
        self.log("val_loss", self.discriminator(self.generator(z)).mean() - self.discriminator(real).mean())

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


class AutomaticModule(pl.LightningModule):
    """One submodule, one optimizer and scheduler, written for automatic optimization."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.generator, _ = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return patterns.regression_loss(self.generator, batch)

    def configure_optimizers(self) -> dict:
        optimizer = patterns.make_optimizer("sgd", self.generator.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return PatternModule.train_dataloader(self)  # type: ignore[arg-type]


FP16_SCALES = {  # two fp16 engines at different loss scales (GPU only: fp16 does not run on CPU)
    "generator": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "discriminator": {"fp16": {"enabled": True, "initial_scale_power": 4}},
}


SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 20, "allgather_bucket_size": 20}}
# offload_optimizer with torch's Adam from configure_optimizers (DeepSpeed asks for its DeepSpeedCPUAdam unless told)
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
VARIANT_CONFIGS = {"small_buckets": SMALL_BUCKETS, "offload": OFFLOAD}


def backward_state(engine) -> dict[str, float]:
    state = {"running_backward": int(engine._running_engine_backward_count), "clipping": engine.gradient_clipping()}
    # ZeRO-3 parameters still marked in use by a submodule once the step is over: gathered for good
    state["in_use"] = sum(bool(getattr(p, "ds_active_sub_modules", None)) for p in engine.module.parameters())
    if isinstance(engine.optimizer, ZeROOptimizer):
        state["depth"] = int(engine.optimizer._backward_active_depth)
    return state


def fit_patterns(stage: int, optimizer: str, steps: int, precision: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """One rank: fit each pattern at ``stage`` with ``optimizer`` for ``steps`` steps; what each ended with.

    A name is one of ``patterns.PATTERNS`` (``+VARIANT`` as :class:`PatternModule` reads it) or ``automatic``
    (single optimizer, automatic optimization). ``TEST_DEEPSPEED_CHOSE_CUDA`` in the environment sets DeepSpeed's
    accelerator to CUDA first, as DeepSpeed picks it by itself on a machine with a GPU.
    """
    if os.environ.get("TEST_DEEPSPEED_CHOSE_CUDA"):
        set_accelerator(CUDA_Accelerator())  # what DeepSpeed picks by itself on a machine with a GPU
    results = {}
    for pattern in names:
        validated = pattern.endswith("+validated")
        if pattern == "automatic":
            module = AutomaticModule(steps)
        elif validated:
            module = ValidatedModule(pattern, optimizer, steps)
        else:
            module = PatternModule(pattern, optimizer, steps)
        strategy = MultiDeepSpeedStrategy(
            stage=stage,
            config=VARIANT_CONFIGS.get(pattern.partition("+")[2]),
            engine_configs=FP16_SCALES if precision == "16-mixed" else None,
            find_unused_parameters=pattern.partition("+")[0] in patterns.PARTIAL_REACH,
        )
        engines_at_end = AtFitEnd(
            lambda s: {
                "engines": {name: backward_state(e) for name, e in s.engines.items()},
                "offloaded": {name: bool(e.zero_cpu_offload()) for name, e in s.engines.items()},
                "loss_scales": {name: float(getattr(e.optimizer, "loss_scale", 0.0)) for name, e in s.engines.items()},
                "dtype": str(next(s.lightning_module.generator.parameters()).dtype),  # fp32 again after teardown
                "device": str(next(s.lightning_module.generator.parameters()).device),  # where it trained
            }
        )
        trainer = cpu_trainer(
            strategy,
            callbacks=[engines_at_end],
            precision=precision,
            accumulate_grad_batches=2 if pattern == "automatic" else 1,
            enable_checkpointing=False,
            use_distributed_sampler=False,
            **({"val_check_interval": 2, "limit_val_batches": 1} if validated else {}),
        )
        trainer.fit(module)
        state = strategy.consolidated_state_dict()  # every rank: gathers ZeRO-3 partitions
        again = strategy.consolidated_state_dict()  # a gathering leaves the module where it was
        results[pattern] = {
            "weights": {k: v.float().clone() for k, v in state.items()},
            "weight_devices": sorted({str(v.device) for v in [*state.values(), *again.values()]}),
            **engines_at_end.value,
            "automatic": module.automatic_optimization,
            "lr": [group["lr"] for opt in strategy.optimizers for group in opt.param_groups],
            "ds_accelerator": get_accelerator().device_name(),
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        }
    return results


def train(stage: int, optimizer: str, steps: int, precision: str, *names: str) -> dict:
    return on_ranks(fit_patterns, stage, optimizer, steps, precision, list(names))[0]


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
VALIDATE_EVERY = 2  # fit_patterns validates "+validated" patterns every 2 training steps


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda stage: f"zero{stage}")
def sgd_run(request: pytest.FixtureRequest) -> dict:
    """One 2-rank launch per stage: every pattern, and the GAN and accumulation with activation checkpointing."""
    return train(request.param, "sgd", 4, "32-true", *patterns.PATTERNS, *CHECKPOINTED, *INTERRUPTED, "gan+validated")


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
def test_gan_with_adam_over_many_steps_matches_pytorch(stage: int) -> None:
    steps = 12
    results = train(stage, "adam", steps, "32-true", "gan", "gan_toggle")
    for pattern in ("gan", "gan_toggle"):
        assert_matches(results[pattern]["weights"], patterns.reference(pattern, "adam", steps), TOLERANCE)
        assert_backward_state_clean(results[pattern])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_states_train_as_plain_pytorch(stage: int) -> None:
    """``offload_optimizer`` on both engines: Adam steps on fp32 partitions in host memory, to PyTorch's weights."""
    steps = 6
    names = ("gan", "gan_zero_first", "zero_grad_unreached")  # the last: zero_grad() must also clear host buffers
    results = train(stage, "adam", steps, "32-true", *(f"{name}+offload" for name in names))
    for name in names:
        result = results[f"{name}+offload"]
        assert result["offloaded"] == {"generator": True, "discriminator": True}
        assert_matches(result["weights"], patterns.reference(name, "adam", steps), TOLERANCE)
        assert_backward_state_clean(result)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_offloaded_step_does_not_apply_the_last_steps_gradient_again(stage: int) -> None:
    """``offload_optimizer``: a parameter reached at one step and not at the next stays put at the next (SGD)."""
    steps = 4
    result = train(stage, "sgd", steps, "32-true", "reach_alternates+offload")["reach_alternates+offload"]
    assert_matches(result["weights"], patterns.reference("reach_alternates", "sgd", steps), TOLERANCE)
    assert_backward_state_clean(result)


def test_single_optimizer_automatic_optimization_matches_pytorch() -> None:
    steps = 6
    result = train(2, "sgd", steps, "32-true", "automatic")["automatic"]
    assert result["automatic"] is True
    assert_matches(result["weights"], patterns.reference_automatic(steps), TOLERANCE)
    # StepLR(gamma=0.5) stepped by Lightning once per optimizer step: 3 steps of 0.2.
    assert result["lr"] == [pytest.approx(0.2 * 0.5**3)]


def test_bf16_gan_trains_close_to_fp32() -> None:
    result = train(2, "sgd", 4, "bf16-mixed", "gan")["gan"]
    assert result["dtype"] == "torch.bfloat16"
    # bf16 keeps ~3 significant digits: compare with the fp32 reference at that resolution.
    assert_matches(result["weights"], patterns.reference("gan", "sgd", 4), 3e-2)


def test_cpu_training_when_deepspeed_chose_cuda() -> None:
    """``Trainer(accelerator="cpu")`` on a GPU machine, where DeepSpeed picks CUDA by itself at import."""
    result = on_ranks(fit_patterns, 2, "sgd", 4, "32-true", ["gan"], env={"TEST_DEEPSPEED_CHOSE_CUDA": "1"})[0]["gan"]
    assert (result["device"], result["ds_accelerator"]) == ("cpu", "cpu")
    assert_matches(result["weights"], patterns.reference("gan", "sgd", 4), TOLERANCE)
