"""Per-rank script: checkpoints with a poisoned part, loaded with each ``weights_only``. Usage: MODE ROOT [CASE ...]

MODE ``train``: one epoch of a distillation with a frozen ZeRO-3 teacher (saved: ``save_frozen=True``), a ZeRO-2
Adam student and its EMA, saved by ``ModelCheckpoint`` to ROOT/ckpts/last.ckpt.
MODE ``load``: for each CASE ``NAME:WEIGHTS_ONLY:CALL[:bypass][:no-ema]`` (WEIGHTS_ONLY ``none``, ``true`` or
``false``; CALL ``fit`` or ``validate``), ``trainer.CALL(ckpt_path=ROOT/cases/NAME/last.ckpt, weights_only=...)``;
prints ``RESULT NAME: ok`` or ``RESULT NAME: ErrorType: message``. With ``bypass`` the strategy's look at the pickles
before loading finds nothing, so only torch's restricted unpickler, DeepSpeed's reads included, stands in the way;
with ``no-ema`` the module has no ``student_ema`` and the strategy no ``ema=``.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
WEIGHTS_ONLY = {"none": None, "true": True, "false": False}


class Distill(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.teacher, self.student = patterns.make_distill_modules()
        self.student_ema = copy.deepcopy(self.student)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        patterns.distill_step(self.teacher, self.student, batch, self.optimizers(), self.manual_backward)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_gap", (self.student_ema(batch[:, :6]) - self.teacher(batch[:, :6])).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("adam", self.student.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(2))

    val_dataloader = train_dataloader


def trainer(root: Path, epochs: int, ema: bool = True) -> pl.Trainer:
    strategy = MultiDeepSpeedStrategy(
        stage=2,
        engine_configs={"teacher": {"zero_optimization": {"stage": 3}}},
        ema={"student_ema": ("student", 0.9)} if ema else None,
        save_frozen=True,
    )
    checkpoints = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, save_top_k=0)
    return cpu_trainer(strategy, max_epochs=epochs, use_distributed_sampler=False, callbacks=[checkpoints])


def load(root: Path, case: str) -> str:
    name, weights_only, call, *flags = case.split(":")
    path = str(root / "cases" / name / "last.ckpt")
    t = trainer(root / "cases" / name / "run", 2, ema="no-ema" not in flags)
    module = Distill()
    if "no-ema" in flags:
        del module.student_ema
    scan = mock.patch("torch.serialization.get_unsafe_globals_in_checkpoint", return_value=[])
    try:
        with scan if "bypass" in flags else mock.patch.dict({}):
            getattr(t, call)(module, ckpt_path=path, weights_only=WEIGHTS_ONLY[weights_only])
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}".replace("\n", " ")
    return "ok"


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "train":
        trainer(root, 1).fit(Distill())
    else:
        for case in sys.argv[3:]:
            print(f"RESULT {case.split(':')[0]}: {load(root, case)}", flush=True)


if __name__ == "__main__":
    main()
    finish()
