"""Per-rank script: a GAN whose generator has an EMA engine, straight or saved after one epoch and resumed.

Usage: run_ema.py OUT DECAY SPEC [SPEC ...], each SPEC ``SOURCE:AVERAGE[:resumed|:plain|:inside]``, a ZeRO stage each
for the generator and its average (``plain``: resumed without ``ema=``, the average a plain submodule then; ``inside``:
resumed from a checkpoint saved inside ``gathered("generator_ema")``, beside the consolidated state dict read there
and outside, as "inside" and "outside"); ``3p0`` is
stage 3 with ``stage3_param_persistence_threshold: 0`` (no parameter stays gathered between forwards, so the average
updates partitions only). Writes OUT on rank 0: {spec: {"weights": consolidated state dict after fit, "start": the
average's weights when training starts}}.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
BATCHES = 2  # per epoch and rank


class Counted(nn.Sequential):
    """``nn.Sequential`` with a buffer counting its training-mode calls: what the average copies, not averages."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x)


def make_gan() -> tuple[Counted, nn.Module, Counted]:
    """Generator, discriminator, and a generator of other weights for the average (setup copies the source in)."""
    generator, discriminator = patterns.make_modules()
    other, _ = patterns.make_modules(seed=7)
    return Counted(*generator), discriminator, Counted(*other)


class EmaGan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator, self.generator_ema = make_gan()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)
        with torch.no_grad():  # a forward gathers a ZeRO-3 average's persistent parameters, which then stay whole
            self.generator_ema(patterns.split(batch)[1])

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(BATCHES))


class AtTrainStart(pl.Callback):
    """The average's whole weights when training starts (after setup, before any step)."""

    def __init__(self) -> None:
        self.value: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        self.value = {k: v.clone() for k, v in state.items() if k.startswith("generator_ema.")}


class SavesInsideGathered(pl.Callback):
    """At the end of the first epoch: ``save_checkpoint`` and ``consolidated_state_dict`` inside ``gathered``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inside: dict[str, torch.Tensor] = {}
        self.outside: dict[str, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        with strategy.gathered("generator_ema"):  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)
            self.inside = strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        self.outside = strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def zero(stage: str) -> dict[str, Any]:
    if stage == "3p0":
        return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return {"zero_optimization": {"stage": int(stage)}}


def fit(
    spec: str, decay: float, epochs: int, root: Path, ckpt_path: str | None = None, *callbacks: pl.Callback
) -> dict[str, Any]:
    source, average = spec.split(":")[:2]
    plain = spec.endswith(":plain") and ckpt_path is not None
    configs = {"generator": zero(source), "discriminator": zero("2"), "generator_ema": zero(average)}
    strategy = MultiDeepSpeedStrategy(
        engine_configs={k: v for k, v in configs.items() if not (plain and k == "generator_ema")},
        ema=None if plain else {"generator_ema": ("generator", decay)},
    )
    start = AtTrainStart()
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1), start, *callbacks],
        default_root_dir=root,
    )
    trainer.fit(EmaGan(), ckpt_path=ckpt_path)
    weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
    return {"weights": weights, "start": start.value, "checkpoint": str(root / "last.ckpt")}


def main() -> None:
    out, decay, *specs = sys.argv[1:]
    results = {}
    for spec in specs:
        root = Path(out).parent / spec.replace(":", "-")
        if spec.endswith(":inside"):
            inside = SavesInsideGathered(root / "first" / "inside.ckpt")
            fit(spec, float(decay), 1, root / "first", None, inside)
            results[spec] = fit(spec, float(decay), 2, root / "second", str(inside.path))
            results[spec].update(inside=inside.inside, outside=inside.outside, files=sorted(os.listdir(root / "first")))
        elif spec.endswith((":resumed", ":plain")):
            fit(spec, float(decay), 1, root / "first")
            results[spec] = fit(spec, float(decay), 2, root / "second", ckpt_path=str(root / "first" / "last.ckpt"))
        else:
            results[spec] = fit(spec, float(decay), 2, root)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
