"""Per-rank script: train the GAN patterns under MultiDeepSpeedStrategy and save rank 0's weights.

Usage: run_patterns.py OUT STAGE OPTIMIZER STEPS PRECISION PATTERN [PATTERN ...]

PATTERN is one of ``patterns.PATTERNS`` or ``automatic`` (single optimizer, automatic optimization).
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")


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
    """A pattern module that Lightning also validates during fit (every 2 training steps, see ``main``)."""

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


def main() -> None:
    out, stage, optimizer, steps, precision, *names = sys.argv[1:]
    if os.environ.get("TEST_DEEPSPEED_CHOSE_CUDA"):
        set_accelerator(CUDA_Accelerator())  # what DeepSpeed picks by itself on a machine with a GPU
    results = {}
    for pattern in names:
        validated = pattern.endswith("+validated")
        if pattern == "automatic":
            module = AutomaticModule(int(steps))
        elif validated:
            module = ValidatedModule(pattern, optimizer, int(steps))
        else:
            module = PatternModule(pattern, optimizer, int(steps))
        strategy = MultiDeepSpeedStrategy(
            stage=int(stage),
            config=VARIANT_CONFIGS.get(pattern.partition("+")[2]),
            engine_configs=FP16_SCALES if precision == "16-mixed" else None,
        )
        engines_at_end = AtFitEnd(
            lambda s: {
                "engines": {name: backward_state(e) for name, e in s.engines.items()},
                "offloaded": {name: bool(e.zero_cpu_offload()) for name, e in s.engines.items()},
                "loss_scales": {name: float(getattr(e.optimizer, "loss_scale", 0.0)) for name, e in s.engines.items()},
                "dtype": str(next(s.lightning_module.generator.parameters()).dtype),  # fp32 again after teardown
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
        device = str(next(module.generator.parameters()).device)
        results[pattern] = {
            "weights": {k: v.float().clone() for k, v in state.items()},
            **engines_at_end.value,
            "automatic": module.automatic_optimization,
            "lr": [group["lr"] for opt in strategy.optimizers for group in opt.param_groups],
            "device": device,
            "ds_accelerator": get_accelerator().device_name(),
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        }
    if trainer.global_rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
