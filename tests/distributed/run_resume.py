"""Per-rank script: train 2 epochs straight, or 1 epoch + save + resume for 1 more; save weights and optimizer state.

Usage: run_resume.py OUT CASE STAGE [STAGE ...] [--after-fit] [--bf16] [--ema] [--weights-only] [--resume-stage=S]
[--no-straight] [--inside-gathered], with CASE ``gan`` (two engines, Adam) or ``distill`` (frozen ZeRO-3 teacher,
saved with ``save_frozen=True``, Adam student). The first epoch is saved by ``ModelCheckpoint(save_last=True)``, or
with ``--after-fit`` by ``trainer.save_checkpoint`` after ``fit`` returns (with ``--inside-gathered``, at
``on_train_end`` inside ``gathered`` of every engine). ``--bf16`` trains in ``bf16-mixed``; ``--ema`` adds
``student_ema``, an EMA engine of the student (distill only); ``--weights-only`` resumes with ``weights_only=True``;
``--resume-stage=S`` resumes at ZeRO-S; ``--no-straight`` skips the straight run. Writes
OUT.RANK: {stage: {"straight": ..., "resumed": ...}}.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
BATCHES = 2  # per epoch and rank


class Resumable(pl.LightningModule):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.automatic_optimization = False
        if case == "gan":
            self.generator, self.discriminator = patterns.make_modules()
        else:
            self.teacher, self.student = patterns.make_distill_modules()
            if "--ema" in sys.argv:
                self.student_ema = copy.deepcopy(self.student)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.case == "gan":
            opt_g, opt_d = self.optimizers()
            patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)
        else:
            patterns.distill_step(self.teacher, self.student, batch, self.optimizers(), self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        trained = [self.generator, self.discriminator] if self.case == "gan" else [self.student]
        return [patterns.make_optimizer("adam", m.parameters()) for m in trained]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = patterns.make_batches(BATCHES)
        return sharded_loader(self, data)


def optimizer_state(engine: object) -> list[torch.Tensor]:
    """Adam's moments and the fp32 master weight of every parameter, whole (ZeRO partitions gathered).

    Read per parameter, so the padding at the end of a ZeRO partition (uninitialised memory) is left out. A bf16
    engine at stage 0 (DeepSpeed's ``FP16_UnfusedOptimizer`` with a torch Adam) keeps fp32 masters of its own.
    """
    state = []
    if engine.zero_optimization_stage() == 0 and engine.bfloat16_enabled():
        for master in (p for group in engine.optimizer.fp32_groups for p in group):
            moments = engine.optimizer.optimizer.state[master]
            state += [moments["exp_avg"].clone(), moments["exp_avg_sq"].clone(), master.detach().clone()]
        return state
    for param in engine.module.parameters():
        if engine.zero_optimization_stage() == 0:
            moments = engine.optimizer.state[param]
            state += [moments["exp_avg"].clone(), moments["exp_avg_sq"].clone(), param.detach().clone()]
        else:
            state += [safe_get_full_optimizer_state(param, key).clone() for key in ("exp_avg", "exp_avg_sq")]
            state.append(safe_get_full_fp32_param(param).clone())
    return state


class SavesInsideGathered(pl.Callback):
    """At the end of training, ``trainer.save_checkpoint`` inside ``gathered`` of every engine."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with contextlib.ExitStack() as blocks:
            for name in trainer.strategy.engines:  # type: ignore[attr-defined]
                blocks.enter_context(trainer.strategy.gathered(name))  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)


def fit(case: str, stage: int, epochs: int, root: Path, ckpt_path: str | None = None, save_after: bool = False) -> dict:
    flags = dict(precision="bf16-mixed") if "--bf16" in sys.argv else {}
    module = Resumable(case)
    engines = {"teacher": {"zero_optimization": {"stage": 3}}} if case == "distill" else {}
    ema = {"student_ema": ("student", 0.9)} if "--ema" in sys.argv else None
    strategy = MultiDeepSpeedStrategy(stage=stage, engine_configs=engines, save_frozen=case == "distill", ema=ema)
    optimizers_at_end = AtFitEnd(lambda s: [t for opt in s.optimizers for t in optimizer_state(opt.engine)])
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1), optimizers_at_end],
        default_root_dir=root,
        **flags,
    )
    if save_after and "--inside-gathered" in sys.argv:
        trainer.callbacks.append(SavesInsideGathered(root / "after-fit.ckpt"))
    trainer.fit(module, ckpt_path=ckpt_path, weights_only=True if "--weights-only" in sys.argv else None)
    if save_after and "--inside-gathered" not in sys.argv:
        trainer.save_checkpoint(root / "after-fit.ckpt")
    return {
        "weights": strategy.consolidated_state_dict(),
        "optimizer": optimizers_at_end.value,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "files": sorted(p.name for p in root.iterdir()),
        "parts": sorted(p.name for p in (root / "last.ckpt" / "engines").iterdir()),
    }


def resume_stage(stage: int) -> int:
    """The stage to resume at: ``--resume-stage=S``, or the stage saved."""
    given = [arg.split("=")[1] for arg in sys.argv if arg.startswith("--resume-stage=")]
    return int(given[0]) if given else stage


def main() -> None:
    out, case, *stages = (arg for arg in sys.argv[1:] if not arg.startswith("--"))
    after_fit = "--after-fit" in sys.argv
    saved = "after-fit.ckpt" if after_fit else "last.ckpt"
    results = {}
    for stage in map(int, stages):
        root = Path(out).parent / f"{case}-{stage}"
        straight = None if "--no-straight" in sys.argv else fit(case, stage, 2, root / "straight")
        fit(case, stage, 1, root / "first", save_after=after_fit)
        resumed = fit(case, resume_stage(stage), 2, root / "second", ckpt_path=str(root / "first" / saved))
        results[stage] = {"straight": straight, "resumed": resumed}
    torch.save(results, f"{out}.{torch.distributed.get_rank()}")


if __name__ == "__main__":
    main()
    finish()
