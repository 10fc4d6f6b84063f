"""Per-rank script: submodules built in ``configure_model`` under ZeRO-3's ``zero.Init``.

Usage: run_configure_model.py OUT CASE

CASE is one of:

* ``config_stage``: ZeRO-3 comes from the strategy's ``config=``, not its ``stage=``;
* ``own_dtype``: the ZeRO-3 teacher's own entry asks for bf16, the default is fp32;
* ``tied``: the student (ZeRO-2) ties its two layers' weights;
* ``fit``: a ZeRO-3 teacher and a ZeRO-3 student, and a plain ``head`` (no optimizer, no entry) set to 0.5 when
  training starts, saved to ``OUT.ckpt``;
* ``test``: a new process tests the checkpoint of ``fit`` (OUT names the same file).

Rank 0 saves what it saw in ``OUT``.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
STEPS = 4
ZERO3 = {"zero_optimization": {"stage": 3}}


class Built(pl.LightningModule):
    """Distillation (frozen teacher, trained student) with both built in ``configure_model``."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.automatic_optimization = False
        self.seen: dict[str, Any] = {}
        self.test_inputs: list[torch.Tensor] = []
        self.test_outputs: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if hasattr(self, "teacher"):
            return
        self.teacher, self.student = patterns.make_distill_modules()
        if self.case in ("fit", "test"):
            self.head = nn.Linear(4, 4)
        if self.case == "tied":
            self.student = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4))
            self.student[2].weight = self.student[0].weight
        self.seen["built_partitioned"] = {
            name: all(hasattr(p, "ds_id") for p in getattr(self, name).parameters()) for name in ("teacher", "student")
        }
        self.seen["teacher_dtype"] = str(next(self.teacher.parameters()).ds_tensor.dtype)

    def on_train_start(self) -> None:
        self.seen["tied_in_training"] = self.case != "tied" or self.student[2].weight is self.student[0].weight
        if self.case == "fit":  # whole again at setup: a plain submodule
            with torch.no_grad():
                for param in self.head.parameters():
                    param.fill_(0.5)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        patterns.distill_step(self.teacher, self.student, batch, self.optimizers(), self.manual_backward)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, _ = patterns.split(batch)
        self.test_inputs.append(real.clone())
        student = self.student(real)
        outputs = [self.teacher(real), student, self.head(student)]
        self.test_outputs.append(torch.cat(outputs, dim=1).float().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("sgd", self.student.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


def strategy(case: str) -> MultiDeepSpeedStrategy:
    if case == "config_stage":
        return MultiDeepSpeedStrategy(stage=2, config=ZERO3)
    if case == "own_dtype":
        return MultiDeepSpeedStrategy(
            stage=2, engine_configs={"teacher": {**ZERO3, "bf16": {"enabled": True}}, "student": {}}
        )
    if case == "tied":
        return MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": ZERO3})
    return MultiDeepSpeedStrategy(stage=3, engine_configs={"teacher": ZERO3})


def main() -> None:
    out, case = sys.argv[1:]
    module = Built(case)
    result: dict[str, Any] = {}
    if case == "test":
        trainer = cpu_trainer(strategy(case), use_distributed_sampler=False)
        trainer.test(module, ckpt_path=f"{out}.ckpt")
        result["inputs"], result["outputs"] = torch.cat(module.test_inputs), torch.cat(module.test_outputs)
    else:
        stages = AtFitEnd(lambda s: {name: e.zero_optimization_stage() for name, e in s.engines.items()})
        callbacks: list[pl.Callback] = [stages]
        if case == "fit":
            callbacks.append(AtFitEnd(lambda s: s.lightning_module.trainer.save_checkpoint(f"{out}.ckpt")))
        trainer = cpu_trainer(
            strategy(case), callbacks=callbacks, enable_checkpointing=False, use_distributed_sampler=False
        )
        trainer.fit(module)
        result["stages"] = stages.value
        result["weights"] = {k: v.float().clone() for k, v in trainer.strategy.consolidated_state_dict().items()}
    result.update(module.seen)
    if trainer.global_rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main()
    finish()
