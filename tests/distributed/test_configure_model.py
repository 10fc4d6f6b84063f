"""Submodules built in ``configure_model`` under ZeRO-3: each engine's config, tied weights, a fresh-process test.

The rank code, :func:`build`, runs one CASE on 2 ranks:

* ``config_stage``: ZeRO-3 comes from the strategy's ``config=``, not its ``stage=``;
* ``own_dtype``: the ZeRO-3 teacher's own entry asks for bf16, the default is fp32;
* ``tied``: the student (ZeRO-2) ties its two layers' weights;
* ``fit``: a ZeRO-3 teacher and a ZeRO-3 student, and a plain ``head`` (no optimizer, no entry) set to 0.5 when
  training starts, saved to the checkpoint path;
* ``test``: a new process tests the checkpoint of ``fit`` (the same path).

Rank 0 returns what it saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks
from tests.distributed.test_patterns import TOLERANCE

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


def build(checkpoint: Path, case: str) -> dict[str, Any] | None:
    """On each rank: ``case`` fitted (or tested from ``checkpoint``); rank 0 returns what it saw, the other None."""
    module = Built(case)
    result: dict[str, Any] = {}
    if case == "test":
        trainer = cpu_trainer(strategy(case), use_distributed_sampler=False)
        trainer.test(module, ckpt_path=str(checkpoint))
        result["inputs"], result["outputs"] = torch.cat(module.test_inputs), torch.cat(module.test_outputs)
    else:
        stages = AtFitEnd(lambda s: {name: e.zero_optimization_stage() for name, e in s.engines.items()})
        callbacks: list[pl.Callback] = [stages]
        if case == "fit":
            callbacks.append(AtFitEnd(lambda s: s.lightning_module.trainer.save_checkpoint(str(checkpoint))))
        trainer = cpu_trainer(
            strategy(case), callbacks=callbacks, enable_checkpointing=False, use_distributed_sampler=False
        )
        trainer.fit(module)
        result["stages"] = stages.value
        result["weights"] = {k: v.float().clone() for k, v in trainer.strategy.consolidated_state_dict().items()}
    result.update(module.seen)
    return result if trainer.global_rank == 0 else None


def run(checkpoint: Path, name: str) -> dict[str, Any]:
    result = on_ranks(build, checkpoint, name, timeout=300)[0]
    assert result is not None
    return result


def test_zero3_from_the_strategy_config_builds_partitioned(tmp_path: Path) -> None:
    """``MultiDeepSpeedStrategy(stage=2, config={"zero_optimization": {"stage": 3}})``: the config's stage wins."""
    result = run(tmp_path / "out.ckpt", "config_stage")
    assert result["built_partitioned"] == {"teacher": True, "student": True}
    assert result["stages"] == {"student": 3}


def test_zero_init_gets_the_zero3_engine_own_config(tmp_path: Path) -> None:
    """The teacher's own entry asks for bf16: its partitions are created in bf16, beside an fp32 student."""
    result = run(tmp_path / "out.ckpt", "own_dtype")
    assert result["teacher_dtype"] == "torch.bfloat16"
    assert result["stages"] == {"student": 2, "teacher": 3}


def test_tied_weights_stay_tied_when_made_whole(tmp_path: Path) -> None:
    """A ZeRO-2 student built under zero.Init is made whole at setup; its two tied layers stay one parameter."""
    result = run(tmp_path / "out.ckpt", "tied")
    assert result["tied_in_training"]
    weights = result["weights"]
    assert torch.equal(weights["student.0.weight"], weights["student.2.weight"])


def test_test_from_a_checkpoint_in_a_fresh_process_at_zero3(tmp_path: Path) -> None:
    """Fit (ZeRO-3 teacher and student) saves; a new process builds them partitioned and tests the checkpoint."""
    checkpoint = tmp_path / "out.ckpt"
    fitted = run(checkpoint, "fit")
    tested = run(checkpoint, "test")
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
