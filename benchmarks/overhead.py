"""Step time of MultiDeepSpeedStrategy (A) against a hand-written loop over raw DeepSpeed engines (B).

One launch per case, on 2 CPU processes from the repository root (``make bench`` runs every case)::

    torchrun --nproc-per-node 2 benchmarks/overhead.py --case gan --stage 2

Both sides build their engines from the same DeepSpeed configs (``lightning_multids.config.engine_config``)
and do the same work per step:

* ``gan``: the discriminator on ``cat(real, fake.detach())``, its backward and step; then the generator's
  loss through the discriminator (whose parameters are frozen for it), its backward and step.
* ``distill``: a frozen teacher engine's logits under ``no_grad``, the student's KL loss, backward, step.

B is written to be correct with raw DeepSpeed: one forward per engine per backward (through ``engine(x)``,
so DeepSpeed's hooks run) and an explicit ``engine.backward``; the discriminator inside the generator's loss
is called as its module, since a second engine's forward would enter its backward. Rounds alternate
A, B, B, A, A, B, ... in this launch; each times ``--steps`` steps after ``--warmup``, excluding start-up and data
loading. Reported: median ms per step of each, and the median (min-max) of per-round ratios A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import StepMeter, summarize
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.config import engine_config, frozen_config

BATCH = 64
SIZES = {"latent": 128, "image": 784, "hidden": 1024, "teacher": 2048, "student": 256, "classes": 10}


def mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(n_in, n_out), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers[:-1])


def gan_modules() -> dict[str, nn.Module]:
    s = SIZES
    return {
        "generator": nn.Sequential(mlp(s["latent"], s["hidden"], s["hidden"], s["image"]), nn.Tanh()),
        "discriminator": mlp(s["image"], s["hidden"], s["hidden"], 1),
    }


def distill_modules() -> dict[str, nn.Module]:
    s = SIZES
    return {
        "teacher": mlp(s["image"], s["teacher"], s["teacher"], s["classes"]),
        "student": mlp(s["image"], s["student"], s["classes"]),
    }


def batches(seed: int, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (images, noise), different on each rank, the same for A and B."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield (
            torch.rand(BATCH, SIZES["image"], generator=generator) * 2 - 1,
            torch.randn(BATCH, SIZES["latent"], generator=generator),
        )


def discriminator_loss(discriminator: Callable, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """One discriminator forward on real and (detached) generated images."""
    logits = discriminator(torch.cat([real, fake.detach()]))
    labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
    return F.binary_cross_entropy_with_logits(logits, labels)


def generator_loss(discriminator: Callable, fake: torch.Tensor) -> torch.Tensor:
    logits = discriminator(fake)
    return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def distill_loss(teacher: Callable, student: Callable, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        targets = F.log_softmax(teacher(images), -1)
    return F.kl_div(F.log_softmax(student(images), -1), targets, log_target=True, reduction="batchmean")


# ---- A: a LightningModule under MultiDeepSpeedStrategy ----------------------------------------------


class GanModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        modules = gan_modules()
        self.generator, self.discriminator = modules["generator"], modules["discriminator"]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(z)
        loss = discriminator_loss(self.discriminator, real, fake)
        opt_d.zero_grad()
        self.manual_backward(loss)
        opt_d.step()
        with self.toggled_optimizer(opt_g):
            loss = generator_loss(self.discriminator, fake)
            opt_g.zero_grad()
            self.manual_backward(loss)
            opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())]


class DistillModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        modules = distill_modules()
        self.teacher, self.student = modules["teacher"], modules["student"]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return distill_loss(self.teacher, self.student, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters())


def run_strategy(case: str, stage: int, steps: int, warmup: int, seed: int) -> list[float]:
    """A: ``warmup + steps`` training steps of the case's LightningModule; the timed steps' seconds."""
    torch.manual_seed(0)
    module = GanModule() if case == "gan" else DistillModule()
    meter = StepMeter(warmup)
    engines = {"teacher": {}} if case == "distill" else {}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiDeepSpeedStrategy(stage=stage, engines=engines),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[meter],
    )
    data = list(batches(seed, warmup + steps))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return meter.times


# ---- B: the same step over raw DeepSpeed engines ----------------------------------------------------


def raw_engines(case: str, stage: int) -> dict[str, Any]:
    """The case's engines built with ``deepspeed.initialize`` from the configs the strategy would use."""
    torch.manual_seed(0)
    modules = gan_modules() if case == "gan" else distill_modules()
    engines = {}
    for name, module in modules.items():
        config = engine_config(name, stage=stage, default={}, override={}, micro_batch_size=BATCH)
        if name == "teacher":
            module.requires_grad_(False)
            engines[name], *_ = deepspeed.initialize(model=module, config=frozen_config(name, config, {}))
            engines[name].eval()
        else:
            optimizer = torch.optim.Adam(module.parameters())
            engines[name], *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engines


def raw_gan_step(engines: dict[str, Any], real: torch.Tensor, z: torch.Tensor) -> None:
    generator, discriminator = engines["generator"], engines["discriminator"]
    fake = generator(z)
    discriminator.backward(discriminator_loss(discriminator, real, fake))
    discriminator.step()
    discriminator.module.requires_grad_(False)  # what toggle_optimizer does in A
    generator.backward(generator_loss(discriminator.module, fake))
    generator.step()
    discriminator.module.requires_grad_(True)


def run_raw(case: str, stage: int, steps: int, warmup: int, seed: int) -> list[float]:
    """B: the same steps as :func:`run_strategy` over raw engines; the timed steps' seconds."""
    engines = raw_engines(case, stage)
    times = []
    for index, (real, z) in enumerate(batches(seed, warmup + steps)):
        start = time.perf_counter()
        if case == "gan":
            raw_gan_step(engines, real, z)
        else:
            loss = distill_loss(engines["teacher"], engines["student"], real)
            engines["student"].backward(loss)
            engines["student"].step()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["gan", "distill"], required=True)
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="outputs/bench/overhead")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    a_runs, b_runs = [], []
    for round_ in range(args.rounds):
        seed = 1000 * round_ + int(os.environ.get("RANK", "0"))
        if round_ % 2 == 0:  # A B, then B A: drift over the launch cancels out of the ratios
            a_runs.append(run_strategy(args.case, args.stage, args.steps, args.warmup, seed))
        b_runs.append(run_raw(args.case, args.stage, args.steps, args.warmup, seed))
        if round_ % 2 == 1:
            a_runs.append(run_strategy(args.case, args.stage, args.steps, args.warmup, seed))
    summary = summarize(a_runs, b_runs)
    if torch.distributed.get_rank() == 0:
        print(
            f"| {args.case} | {args.stage} | {summary['a_ms']:.1f} | {summary['b_ms']:.1f} | "
            f"{summary['ratio']:.3f} ({summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}) |",
            flush=True,
        )
        out = Path(args.out) / f"{args.case}_zero{args.stage}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), **summary}, indent=2))


if __name__ == "__main__":
    main()
