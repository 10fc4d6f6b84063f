"""Per-rank script for checkpoint scenarios. Usage: run_checkpoint.py MODE ROOT

MODE ``train``: 1 epoch of the GAN at ZeRO-3 with ModelCheckpoint; saves the live weights to ROOT/live.pt.
MODE ``kill``: 2 epochs; rank 1 is SIGKILLed while the epoch-1 checkpoint is being written.
MODE ``kill_between_renames``: 2 epochs; rank 0 is SIGKILLed between the two renames that replace last.ckpt.
MODE ``resume`` / ``resume_last``: resume from ROOT/ckpts/last.ckpt (``resume_last``: ``ckpt_path="last"``) up to a
third epoch; writes ROOT/resumed.json: the epoch training started at, and the epoch and step it ended at.
MODE ``errors``: bad ckpt_path values; prints ``RESULT name: message``.
MODE ``gathered``: ``trainer.validate`` at ZeRO 0-3 of a GAN whose ``validation_step`` samples inside
``gathered("generator")``; writes ROOT/gathered.json, {stage: val_score or the error}.
MODE ``validate``: ``trainer.validate(ckpt_path=ROOT/ckpts/last.ckpt)`` in a fresh process; writes ROOT/val.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from deepspeed import DeepSpeedEngine
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish

warnings.filterwarnings("ignore")


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, z = patterns.split(batch)
        self.log("val_score", self.discriminator(self.generator(z)).mean(), sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(2), batch_size=4)

    val_dataloader = train_dataloader


class GatheredGAN(GAN):
    """The GAN sampling inside ``gathered``, as a generation loop would."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, z = patterns.split(batch)
        with self.trainer.strategy.gathered("generator") as generator:  # type: ignore[attr-defined]
            fake = generator(z)
        self.log("val_score", self.discriminator(fake).mean(), sync_dist=True)


class Student(pl.LightningModule):
    """A module with other engines than the GAN's, to resume a GAN checkpoint into."""

    def __init__(self) -> None:
        super().__init__()
        _, self.student = patterns.make_distill_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.student(batch[:, :6]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.1)

    train_dataloader = GAN.train_dataloader


def trainer(root: Path, epochs: int) -> pl.Trainer:
    return cpu_trainer(
        MultiDeepSpeedStrategy(stage=3),
        max_epochs=epochs,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpts", save_last=True, save_top_k=-1)],
    )


def kill_during_second_save() -> None:
    """SIGKILL rank 1 after it wrote its first engine of the second checkpoint, before the second engine."""
    original, calls = DeepSpeedEngine.save_checkpoint, []

    def save_checkpoint(self: DeepSpeedEngine, *args: object, **kwargs: object) -> object:
        calls.append(1)
        # epoch 0 writes epoch=0-step=4.ckpt and last.ckpt (2 engines each); die inside epoch=1-step=8.ckpt
        if len(calls) == 6 and os.environ["LOCAL_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    DeepSpeedEngine.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def kill_between_renames() -> None:
    """SIGKILL rank 0 right after it moved last.ckpt aside (to last.old.ckpt), before the new one takes its place."""
    from lightning_multids import checkpoint

    original = os.replace

    def replace(source: object, target: object) -> None:
        original(source, target)
        if Path(str(target)).name == "last.old.ckpt":
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.os.replace = replace  # type: ignore[attr-defined]


class StartEpoch(pl.Callback):
    """The epoch training starts at, after any resume."""

    def __init__(self) -> None:
        self.value = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.value = trainer.current_epoch


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "train":
        t = trainer(root, 1)
        t.fit(GAN())
        weights = t.strategy.consolidated_state_dict()
        if t.global_rank == 0:
            torch.save(weights, root / "live.pt")
    elif mode == "kill":
        kill_during_second_save()
        trainer(root, 2).fit(GAN())
    elif mode == "kill_between_renames":
        kill_between_renames()
        trainer(root, 2).fit(GAN())
    elif mode in ("resume", "resume_last"):
        t, start = trainer(root, 3), StartEpoch()
        t.callbacks.append(start)  # type: ignore[attr-defined]
        t.fit(GAN(), ckpt_path="last" if mode == "resume_last" else str(root / "ckpts" / "last.ckpt"))
        if t.global_rank == 0:
            result = {"start_epoch": start.value, "epoch": t.current_epoch, "step": t.global_step}
            (root / "resumed.json").write_text(json.dumps(result))
    elif mode == "validate":
        t = cpu_trainer(MultiDeepSpeedStrategy(stage=3))
        (metrics,) = t.validate(GAN(), ckpt_path=str(root / "ckpts" / "last.ckpt"))
        if t.global_rank == 0:
            (root / "val.json").write_text(json.dumps(metrics))
    elif mode == "gathered":
        scores = {}
        for stage in range(4):
            try:
                (metrics,) = cpu_trainer(MultiDeepSpeedStrategy(stage=stage)).validate(GatheredGAN())
                scores[stage] = metrics["val_score"]
            except ValueError as error:
                scores[stage] = str(error)
        if torch.distributed.get_rank() == 0:
            (root / "gathered.json").write_text(json.dumps(scores))
    elif mode == "errors":
        (root / "plain.ckpt").write_bytes(b"not a checkpoint")
        cases = {
            "missing": (GAN, root / "nowhere.ckpt"),
            "not_ours": (GAN, root / "plain.ckpt"),
            "other_engines": (Student, root / "ckpts" / "last.ckpt"),
        }
        for name, (module, path) in cases.items():
            try:
                trainer(root / name, 2).fit(module(), ckpt_path=str(path))
            except ValueError as err:
                print(f"RESULT {name}: {err}".replace("\n", " "), flush=True)
            else:
                print(f"RESULT {name}: no error", flush=True)


if __name__ == "__main__":
    main()
    finish()
