"""Per-rank script: frozen engines (distillation, a frozen engine in the middle, a DeepSpeed-config optimizer).

Usage: run_frozen.py OUT STEPS PRECISION SPEC [SPEC ...], each SPEC ``case:frozen_stage:trained_stage`` (a frozen
stage ``3o``: ZeRO-3 with ``offload_param`` to the CPU) with case
``distill`` (frozen teacher, trained student), ``frozen_middle`` (loss = frozen critic(generator(z))),
``frozen_twice`` (the same and frozen critic(real) in one loss) or
``config_optimizer`` (the student's optimizer comes from its DeepSpeed config).
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")

SGD_CONFIG = {"optimizer": {"type": "SGD", "params": {"lr": 0.2}}}


class FrozenModule(pl.LightningModule):
    def __init__(self, case: str, steps: int) -> None:
        super().__init__()
        self.case, self.steps = case, steps
        self.automatic_optimization = False  # user-managed accumulation
        if case in patterns.FROZEN_IN_THE_MIDDLE:
            self.trained, _ = patterns.make_modules()
            _, self.frozen = patterns.make_modules()
        elif case != "configure_model":
            self.frozen, self.trained = patterns.make_distill_modules()

    def configure_model(self) -> None:
        """Case ``configure_model``: the submodules are built here, under the strategy's ZeRO-3 init."""
        if self.case == "configure_model" and not hasattr(self, "frozen"):
            self.frozen, self.trained = patterns.make_distill_modules()
            self.built_partitioned = {
                "frozen": all(hasattr(p, "ds_id") for p in self.frozen.parameters()),
                "trained": all(hasattr(p, "ds_id") for p in self.trained.parameters()),
            }

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        if self.case in patterns.FROZEN_IN_THE_MIDDLE:
            patterns.FROZEN_IN_THE_MIDDLE[self.case](self.trained, self.frozen, batch, opt, self.manual_backward)
        else:
            patterns.distill_step(self.frozen, self.trained, batch, opt, self.manual_backward)

    def configure_optimizers(self) -> torch.optim.Optimizer | None:
        if self.case == "config_optimizer":
            return None
        return patterns.make_optimizer("sgd", self.trained.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = patterns.make_batches(self.steps)
        return sharded_loader(self, data)


class ReadSummary(pl.Callback):
    """What the trainer's ModelSummary callback counts at the start of fit, per top-level submodule."""

    def __init__(self, summary: ModelSummary) -> None:
        self.summary = summary
        self.value: dict = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        counted = self.summary._summary(trainer, pl_module)
        layers = dict(zip(counted.layer_names, counted.param_nums, strict=True))
        self.value = {"total": counted.total_parameters, "layers": layers}


def partition_share(module: torch.nn.Module) -> float:
    """The fraction of ``module``'s parameters this rank holds (1.0 when not partitioned)."""
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
    full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    return local / full


def frozen_config(stage: str) -> dict:
    if stage == "3o":
        return {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    return {"zero_optimization": {"stage": int(stage)}}


def main() -> None:
    out, steps, precision, *specs = sys.argv[1:]
    results = {}
    for spec in specs:
        case, frozen_stage, trained_stage = spec.split(":")
        module = FrozenModule(case, int(steps))
        trained = {"zero_optimization": {"stage": int(trained_stage)}}
        if case == "config_optimizer":
            trained.update(SGD_CONFIG)
        strategy = MultiDeepSpeedStrategy(engine_configs={"frozen": frozen_config(frozen_stage), "trained": trained})
        engines_at_end = AtFitEnd(
            lambda s: {
                "engines": sorted(s.engines),
                "frozen_has_optimizer_state": bool(getattr(s.engines["frozen"], "basic_optimizer", None)),
                "frozen_offloads_parameters": bool(s.engines["frozen"].zero_offload_param()),
                "dtype": str(next(s.lightning_module.trained.parameters()).dtype),  # fp32 again after teardown
                "in_use": [  # ZeRO-3 parameters a submodule still marks as in use after the last step
                    name
                    for name, p in s.lightning_module.named_parameters()
                    if getattr(p, "ds_active_sub_modules", None)
                ],
            }
        )
        summary = ModelSummary()
        read_summary = ReadSummary(summary)
        trainer = cpu_trainer(
            strategy,
            callbacks=[engines_at_end, summary, read_summary],
            enable_model_summary=True,
            precision=precision,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        state = strategy.consolidated_state_dict()
        results[spec] = {
            "weights": {
                k.replace("trained.", ""): v.float().clone() for k, v in state.items() if k.startswith("trained.")
            },
            "frozen_share": partition_share(module.frozen),
            "frozen_training": module.frozen.training,
            "frozen_requires_grad": any(p.requires_grad for p in module.frozen.parameters()),
            "optimizers": [opt.name for opt in strategy.optimizers],
            **engines_at_end.value,
            "built_partitioned": getattr(module, "built_partitioned", None),
            "trained_partitioned": any(hasattr(p, "ds_id") for p in module.trained.parameters()),
            "case": case,
            "summary": read_summary.value,
            "summary_restored": "_summary" not in vars(summary),
        }
    if trainer.global_rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
