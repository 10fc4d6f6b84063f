"""Step time of MultiDeepSpeedStrategy (A) against a hand-written loop over raw DeepSpeed engines (B).

One launch per case, on 2 CPU processes from the repository root (``make bench`` runs every case)::

    torchrun --nproc-per-node 2 benchmarks/overhead.py --case gan --stage 2

GPU mode, on every GPU of one machine (nccl), with models of hundreds of millions of parameters::

    torchrun --nproc-per-node 1 benchmarks/overhead.py --case gan --stage 2 --device cuda --precision bf16-mixed

Both sides build their engines from the same DeepSpeed configs (``lightning_multids.config.engine_config``)
and do the same work per step:

* ``gan``: the discriminator on ``cat(real, fake.detach())``, its backward and step; then the generator's
  loss through the discriminator (whose parameters are frozen for it), its backward and step.
* ``distill``: a frozen teacher engine's logits under ``no_grad``, the student's KL loss, backward, step.

B is written to be correct with raw DeepSpeed: one forward per engine per backward (through ``engine(x)``,
so DeepSpeed's hooks run) and an explicit ``engine.backward``; the discriminator inside the generator's loss
is called as its module, since a second engine's forward would enter its backward. Rounds alternate
A, B, B, A, A, B, ... in this launch; each times ``--steps`` steps after ``--warmup``, excluding start-up and data
loading (the batches are made on the device before the rounds). Reported: median ms per step and samples per
second (all ranks) of each, and the median (min-max) of per-round ratios A/B of the step time. On a GPU each
step ends with ``torch.cuda.synchronize()`` on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import BARE, StepMeter, release_memory, summarize, synchronize
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.config import engine_config, frozen_config

SIZES = {
    # --size cpu: a few million parameters per engine, for 2 CPU processes.
    "cpu": dict(batch=64, latent=128, image=784, classes=10, hidden=1024, teacher=2048, student=256),
    # --size gpu: GAN 172 M + 168 M parameters, teacher 352 M, student 38 M.
    "gpu": dict(batch=256, latent=512, image=4096, classes=1000, hidden=8192, teacher=16384, student=4096),
}
LAYERS = {"cpu": {"gan_layers": 2, "student_layers": 1}, "gpu": {"gan_layers": 3, "student_layers": 2}}
"""Hidden layers per GAN model and in the student, per ``--size``; the teacher has 2."""
S = {**SIZES["cpu"], **LAYERS["cpu"]}
"""The sizes of this launch (``--size``)."""


def mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(n_in, n_out), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers[:-1])


def gan_modules() -> dict[str, nn.Module]:
    hidden = [S["hidden"]] * S["gan_layers"]
    return {
        "generator": nn.Sequential(mlp(S["latent"], *hidden, S["image"]), nn.Tanh()),
        "discriminator": mlp(S["image"], *hidden, 1),
    }


def distill_modules() -> dict[str, nn.Module]:
    return {
        "teacher": mlp(S["image"], S["teacher"], S["teacher"], S["classes"]),
        "student": mlp(S["image"], *[S["student"]] * S["student_layers"], S["classes"]),
    }


def batches(seed: int, steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (images, noise) on ``device``, different on each rank, the same for A and B."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            (torch.rand(S["batch"], S["image"], generator=generator) * 2 - 1).to(device),
            torch.randn(S["batch"], S["latent"], generator=generator).to(device),
        )
        for _ in range(steps)
    ]


def discriminator_loss(discriminator: Callable, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """One discriminator forward on real and (detached) generated images."""
    logits = discriminator(torch.cat([real.to(fake.dtype), fake.detach()])).float()
    labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)]).to(logits.device)
    return F.binary_cross_entropy_with_logits(logits, labels)


def generator_loss(discriminator: Callable, fake: torch.Tensor) -> torch.Tensor:
    logits = discriminator(fake).float()
    return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def distill_loss(teacher: Callable, student: Callable, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        targets = F.log_softmax(teacher(images).float(), -1)
    return F.kl_div(F.log_softmax(student(images).float(), -1), targets, log_target=True, reduction="batchmean")


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


@dataclass(frozen=True)
class Run:
    """What one launch measures: the case, the ZeRO stage, the device and the Trainer precision flag."""

    case: str
    stage: int
    device: str
    precision: str

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision, torch.float32)


def run_strategy(run: Run, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> list[float]:
    """A: a fit of the case's LightningModule over ``data``; the seconds of each step after ``warmup``."""
    torch.manual_seed(0)
    module = GanModule() if run.case == "gan" else DistillModule()
    meter = StepMeter(warmup)
    engines = {"teacher": {}} if run.case == "distill" else {}
    trainer = pl.Trainer(
        accelerator="gpu" if run.device == "cuda" else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=MultiDeepSpeedStrategy(stage=run.stage, engine_configs=engines),
        precision=run.precision,
        max_epochs=1,
        **BARE,
        use_distributed_sampler=False,
        callbacks=[meter],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return meter.times


# ---- B: the same step over raw DeepSpeed engines ----------------------------------------------------


def raw_engines(run: Run) -> dict[str, Any]:
    """The case's engines built with ``deepspeed.initialize`` from the configs the strategy would use."""
    torch.manual_seed(0)
    modules = gan_modules() if run.case == "gan" else distill_modules()
    engines = {}
    for name, module in modules.items():
        config = engine_config(
            name,
            stage=run.stage,
            default={},
            override={},
            precision=run.precision,
            micro_batch_size=S["batch"],
            device_type=run.device,
        )
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


def run_raw(run: Run, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> list[float]:
    """B: the steps of :func:`run_strategy` over raw engines; the seconds of each step after ``warmup``."""
    engines = raw_engines(run)
    times = []
    for index, (real, z) in enumerate(data):
        start = time.perf_counter()
        real, z = real.to(run.dtype), z.to(run.dtype)  # A's engines cast their inputs on entry
        if run.case == "gan":
            raw_gan_step(engines, real, z)
        else:
            loss = distill_loss(engines["teacher"], engines["student"], real)
            engines["student"].backward(loss)
            engines["student"].step()
        synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["gan", "distill"], required=True)
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true")
    parser.add_argument("--size", choices=sorted(SIZES), help="model sizes (default: the device's)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="outputs/bench/overhead")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    size = args.size or ("gpu" if args.device == "cuda" else "cpu")
    S.update({**SIZES[size], **LAYERS[size]})
    run = Run(args.case, args.stage, args.device, args.precision)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)
    a_runs, b_runs = [], []
    for round_ in range(args.rounds):
        seed = 1000 * round_ + int(os.environ.get("RANK", "0"))
        data = batches(seed, args.warmup + args.steps, device or torch.device("cpu"))
        sides = [run_strategy, run_raw] if round_ % 2 == 0 else [run_raw, run_strategy]  # A B, then B A
        for side in sides:
            (a_runs if side is run_strategy else b_runs).append(side(run, data, args.warmup))
            release_memory()
    report(args, summarize(a_runs, b_runs))


def report(args: argparse.Namespace, summary: dict[str, float]) -> None:
    """Print the table row on rank 0 and save the summary as JSON."""
    if torch.distributed.get_rank() != 0:
        return
    samples = S["batch"] * torch.distributed.get_world_size()
    summary["a_samples_per_s"] = samples / (summary["a_ms"] / 1e3)
    summary["b_samples_per_s"] = samples / (summary["b_ms"] / 1e3)
    print(
        f"| {args.case} | {args.stage} | {args.precision} | {summary['a_ms']:.1f} | {summary['b_ms']:.1f} | "
        f"{summary['a_samples_per_s']:.0f} | {summary['b_samples_per_s']:.0f} | "
        f"{summary['ratio']:.3f} ({summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}) |",
        flush=True,
    )
    suffix = "" if args.device == "cpu" and args.precision == "32-true" else f"_{args.device}_{args.precision}"
    out = Path(args.out) / f"{args.case}_zero{args.stage}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "sizes": S, **summary}, indent=2))


if __name__ == "__main__":
    main()
