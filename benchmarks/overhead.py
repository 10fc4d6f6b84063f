"""Step time of MultiDeepSpeedStrategy (A) against a hand-written loop over raw DeepSpeed engines (B).

One launch per case, on 2 CPU processes from the repository root (``make bench`` runs every case)::

    torchrun --nproc-per-node 2 benchmarks/overhead.py --case gan --stage 2
    torchrun --nproc-per-node 2 benchmarks/overhead.py --case gan --stage 2 --arch transformer

GPU mode, on every GPU of one machine (nccl), with models of hundreds of millions of parameters::

    torchrun --nproc-per-node 1 benchmarks/overhead.py --case gan --stage 2 --device cuda --precision bf16-mixed

Both sides build their engines from the same DeepSpeed configs (``lightning_multids._config.engine_config``)
and do the same work per step:

* ``gan``: the discriminator on ``cat(real, fake.detach())``, its backward and step; then the generator's
  loss through the discriminator (whose parameters are frozen for it), its backward and step.
* ``distill``: a frozen teacher engine's logits under ``no_grad``, the student's KL loss, backward, step.
* ``single``: one model (the teacher's architecture) trained alone with cross-entropy: one engine.

``--arch mlp`` (the default) builds the models from linear layers; ``--arch transformer`` from pre-norm
transformer blocks over the image cut into patches (12 parameter tensors per block; hundreds per model).
On a GPU a third side runs where it applies (``distill`` and ``single``): C, the same LightningModule under
Lightning's own ``DeepSpeedStrategy`` (one engine over the whole module, the teacher frozen inside it;
Lightning refuses it on a CPU).

B is written to be correct with raw DeepSpeed: one forward per engine per backward (through ``engine(x)``,
so DeepSpeed's hooks run) and an explicit ``engine.backward``; the discriminator inside the generator's loss
is called as its module, since a second engine's forward would enter its backward. Rounds alternate
A, B, B, A, A, B, ... in this launch (C after both); each times ``--steps`` steps after ``--warmup``, excluding
start-up and data loading (the batches are made on the device before the rounds). Reported: median ms per
step and samples per second (all ranks) of each, and the median (min-max) of per-round ratios A/B (and A/C)
of the step time. On a GPU each step ends with ``torch.cuda.synchronize()`` on every side, and the peak
``torch.cuda.max_memory_allocated`` of each side on rank 0 is reported beside the ZeRO formula's model states.
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
from common import BARE, StepMeter, formula, release_memory, summarize, synchronize
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._compat.deepspeed import release_engine
from lightning_multids._config import engine_config, frozen_config, sized_buckets

SIZES = {
    # --size cpu: a few million parameters per engine, for 2 CPU processes.
    "cpu": dict(batch=64, latent=128, image=784, classes=10, hidden=1024, teacher=2048, student=256),
    # --size gpu: GAN 172 M + 168 M parameters, teacher 352 M, student 38 M.
    "gpu": dict(batch=256, latent=512, image=4096, classes=1000, hidden=8192, teacher=16384, student=4096),
    # --size tiny: compute near zero, the graphs of the GPU models (benchmarks/host.py).
    "tiny": dict(batch=2, latent=8, image=16, classes=2, hidden=8, teacher=8, student=8),
}
LAYERS = {
    "cpu": {"gan_layers": 2, "student_layers": 1},
    "gpu": {"gan_layers": 3, "student_layers": 2},
    "tiny": {"gan_layers": 3, "student_layers": 2},
}
"""Hidden layers per GAN model and in the student, per ``--size``; the teacher has 2."""
TRANSFORMER = {
    # width, heads, pixels per token (the image is cut into image / patch tokens), blocks per model
    "cpu": dict(width=64, heads=4, patch=28, gan_blocks=6, teacher_blocks=12, student_blocks=4),
    "gpu": dict(width=1024, heads=16, patch=64, gan_blocks=12, teacher_blocks=24, student_blocks=6),
    "tiny": dict(width=8, heads=2, patch=4, gan_blocks=12, teacher_blocks=24, student_blocks=6),
}
"""``--arch transformer`` at gpu: GAN 2 × 12 blocks (151 parameter tensors; 185 M and 151 M parameters), teacher
24 blocks (295 tensors, 303 M), student 6 (79, 77 M). At cpu: GAN 79 tensors each (0.5 M and 0.3 M), teacher 151
(0.6 M), student 55 (0.2 M)."""
S: dict[str, Any] = {**SIZES["cpu"], **LAYERS["cpu"], **TRANSFORMER["cpu"], "arch": "mlp"}
"""The sizes of this launch (``--size``, ``--arch``)."""


def mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(n_in, n_out), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers[:-1])


class Block(nn.Module):
    """A pre-norm transformer block: self-attention and a 4x MLP, each with a residual (12 parameter tensors).

    Written out rather than ``nn.TransformerEncoderLayer``, whose attention reads ``out_proj.weight`` without
    calling ``out_proj``: ZeRO-3 gathers a module's parameters only when the module itself is called.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.out(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Encoder(nn.Module):
    """Image patches (or a latent vector) to tokens, ``blocks`` transformer blocks, then a head per token or pooled."""

    def __init__(self, blocks: int, out: int, latent: int | None = None, pool: bool = True) -> None:
        super().__init__()
        width, self.tokens, self.pool = S["width"], S["image"] // S["patch"], pool
        self.from_latent = latent is not None
        self.embed = nn.Linear(latent, self.tokens * width) if latent else nn.Linear(S["patch"], width)
        self.position = nn.Parameter(torch.zeros(self.tokens, width))
        self.blocks = nn.Sequential(*[Block(width, S["heads"]) for _ in range(blocks)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (len(x), self.tokens, -1)
        h = self.embed(x).view(shape) if self.from_latent else self.embed(x.view(shape))
        h = self.norm(self.blocks(h + self.position))
        return self.head(h.mean(1)) if self.pool else self.head(h).flatten(1)


def gan_modules() -> dict[str, nn.Module]:
    if S["arch"] == "transformer":
        return {
            "generator": nn.Sequential(Encoder(S["gan_blocks"], S["patch"], latent=S["latent"], pool=False), nn.Tanh()),
            "discriminator": Encoder(S["gan_blocks"], 1),
        }
    hidden = [S["hidden"]] * S["gan_layers"]
    return {
        "generator": nn.Sequential(mlp(S["latent"], *hidden, S["image"]), nn.Tanh()),
        "discriminator": mlp(S["image"], *hidden, 1),
    }


def distill_modules() -> dict[str, nn.Module]:
    if S["arch"] == "transformer":
        return {
            "teacher": Encoder(S["teacher_blocks"], S["classes"]),
            "student": Encoder(S["student_blocks"], S["classes"]),
        }
    return {
        "teacher": mlp(S["image"], S["teacher"], S["teacher"], S["classes"]),
        "student": mlp(S["image"], *[S["student"]] * S["student_layers"], S["classes"]),
    }


def case_modules(case: str) -> dict[str, nn.Module]:
    """The submodules of ``case``, built from the same seed on every side."""
    torch.manual_seed(0)
    if case == "gan":
        return gan_modules()
    if case == "distill":
        return distill_modules()
    return {"model": distill_modules()["teacher"]}


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


def classify_loss(model: Callable, images: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a label read off each image (which of its first pixels is largest)."""
    return F.cross_entropy(model(images).float(), images[:, : S["classes"]].argmax(1))


# ---- A: a LightningModule under MultiDeepSpeedStrategy ----------------------------------------------


class GanModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        modules = case_modules("gan")
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
    """The teacher is frozen here, so that Lightning's ``DeepSpeedStrategy`` (side C) can hold it in its engine."""

    def __init__(self) -> None:
        super().__init__()
        modules = case_modules("distill")
        self.teacher, self.student = modules["teacher"], modules["student"]
        self.teacher.requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return distill_loss(self.teacher, self.student, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters())


class SingleModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = case_modules("single")["model"]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return classify_loss(self.model, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters())


MODULES = {"gan": GanModule, "distill": DistillModule, "single": SingleModule}


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


def fit(
    run: Run, strategy: Strategy, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, meter: StepMeter | None
) -> list[float]:
    """Fit the case's LightningModule on ``data`` under ``strategy``; the seconds of each step after ``warmup``."""
    module = MODULES[run.case]()
    meter = meter or StepMeter(warmup)
    trainer = pl.Trainer(
        accelerator="gpu" if run.device == "cuda" else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        precision=run.precision,  # type: ignore[arg-type]
        max_epochs=1,
        **BARE,
        use_distributed_sampler=False,
        callbacks=[meter],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return meter.times


def run_strategy(
    run: Run, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, meter: StepMeter | None = None
) -> list[float]:
    """A: the case's LightningModule under MultiDeepSpeedStrategy (a frozen teacher gets its own engine)."""
    engines = {"teacher": {}} if run.case == "distill" else {}
    return fit(run, MultiDeepSpeedStrategy(stage=run.stage, engine_configs=engines), data, warmup, meter)


def run_lightning(run: Run, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> list[float]:
    """C: the same LightningModule under Lightning's DeepSpeedStrategy: one engine, the teacher frozen inside it."""
    config = engine_config(
        "module", stage=run.stage, default={}, override={}, precision=run.precision,
        micro_batch_size=S["batch"], device_type=run.device,
    )  # fmt: skip
    del config["gradient_accumulation_steps"]  # Lightning sets it from the Trainer, and refuses it in the config
    return fit(run, DeepSpeedStrategy(config=config), data, warmup, None)


# ---- B: the same step over raw DeepSpeed engines ----------------------------------------------------


def raw_engines(run: Run) -> dict[str, Any]:
    """The case's engines built with ``deepspeed.initialize`` from the configs the strategy would use."""
    engines = {}
    for name, module in case_modules(run.case).items():
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
            config = sized_buckets(config, sum(p.numel() for p in module.parameters()))
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


def raw_step(run: Run, engines: dict[str, Any], real: torch.Tensor, z: torch.Tensor) -> None:
    """One step of the case over raw engines."""
    if run.case == "gan":
        raw_gan_step(engines, real, z)
        return
    trained = engines["student"] if run.case == "distill" else engines["model"]
    if run.case == "distill":
        trained.backward(distill_loss(engines["teacher"], trained, real))
    else:
        trained.backward(classify_loss(trained, real))
    trained.step()


def run_raw(run: Run, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> list[float]:
    """B: the steps of :func:`run_strategy` over raw engines; the seconds of each step after ``warmup``."""
    engines = raw_engines(run)
    times = []
    for index, (real, z) in enumerate(data):
        start = time.perf_counter()
        real, z = real.to(run.dtype), z.to(run.dtype)  # A's engines cast their inputs on entry
        raw_step(run, engines, real, z)
        synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    release_raw(engines)
    return times


def release_raw(engines: dict[str, Any]) -> None:
    """Free B's engines as A's strategy frees its own at teardown: left alone, their hooks keep each run's engines
    (and on a GPU their memory) alive into the next round and the next case of the launch."""
    for engine in engines.values():
        release_engine(engine)


# ---- the launch ---------------------------------------------------------------------------------------


def model_states(run: Run, world_size: int) -> float:
    """Bytes of model state per rank that the ZeRO formula gives the case's engines (frozen ones: weights only)."""
    total = 0.0
    for name, module in case_modules(run.case).items():
        psi = sum(p.numel() for p in module.parameters())
        if name == "teacher":
            total += psi * run.dtype.itemsize / (world_size if run.stage == 3 else 1)
        else:
            total += formula(run.stage, psi, world_size)
    return total


def configure(args: argparse.Namespace) -> None:
    """Set the sizes of this launch (``S``) from ``--size`` and ``--arch``."""
    size = args.size or ("gpu" if args.device == "cuda" else "cpu")
    S.update({**SIZES[size], **LAYERS[size], **TRANSFORMER[size], "arch": args.arch})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=sorted(MODULES), required=True, help="one or more, in turn")
    parser.add_argument("--stage", nargs="+", type=int, choices=[0, 1, 2, 3], required=True, help="one or more")
    parser.add_argument("--arch", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true")
    parser.add_argument("--size", choices=sorted(SIZES), help="model sizes (default: the device's)")
    parser.add_argument("--steps", type=int, help="timed steps per round (default: 50)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, help="rounds per side (default: 6 on a CPU, 8 on a GPU)")
    parser.add_argument("--out", default="outputs/bench/overhead")
    args = parser.parse_args(argv)
    args.steps = args.steps or 50
    args.rounds = args.rounds or (8 if args.device == "cuda" else 6)
    return args


def main() -> None:
    """Each stage given, and within it each case, in this one launch (one report row and file each)."""
    args = parse()
    warnings.filterwarnings("ignore")
    for stage in args.stage:
        for case in args.case:
            measure(argparse.Namespace(**{**vars(args), "case": case, "stage": stage}))


def measure(args: argparse.Namespace) -> None:
    """One case at one stage: the rounds of each side, then the report."""
    configure(args)
    run = Run(args.case, args.stage, args.device, args.precision)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)
    sides: dict[str, Callable] = {"a": run_strategy, "b": run_raw}
    if run.device == "cuda" and run.case != "gan":
        sides["c"] = run_lightning
    times: dict[str, list[list[float]]] = {side: [] for side in sides}
    peaks: dict[str, int] = {}
    for round_ in range(args.rounds):
        seed = 1000 * round_ + int(os.environ.get("RANK", "0"))
        data = batches(seed, args.warmup + args.steps, device or torch.device("cpu"))
        order = ["a", "b"] if round_ % 2 == 0 else ["b", "a"]  # A B, then B A
        for side in order + [s for s in sides if s not in order]:
            if device is not None:
                torch.cuda.reset_peak_memory_stats(device)
            times[side].append(sides[side](run, data, args.warmup))
            if device is not None:
                peaks[side] = max(peaks.get(side, 0), torch.cuda.max_memory_allocated(device))
            release_memory()
    summary = summarize(times["a"], times["b"])
    if "c" in times:
        versus_c = summarize(times["a"], times["c"])
        summary.update(
            c_ms=versus_c["b_ms"], **{f"{key}_c": versus_c[key] for key in ("ratio", "ratio_min", "ratio_max")}
        )
    if peaks:
        summary.update({f"{side}_peak_mib": peak / 2**20 for side, peak in peaks.items()})
        summary["formula_mib"] = model_states(run, torch.distributed.get_world_size()) / 2**20
    report(args, summary)


def report(args: argparse.Namespace, summary: dict[str, float]) -> None:
    """Print the table row on rank 0 and save the summary as JSON."""
    if torch.distributed.get_rank() != 0:
        return
    samples = S["batch"] * torch.distributed.get_world_size()
    cells = [args.case, args.arch, args.stage, args.precision]
    for side in "abc":
        if f"{side}_ms" in summary:
            summary[f"{side}_samples_per_s"] = samples / (summary[f"{side}_ms"] / 1e3)
            cells += [f"{summary[f'{side}_ms']:.1f}", f"{summary[f'{side}_samples_per_s']:.0f}"]
    for suffix in ("", "_c") if "c_ms" in summary else ("",):
        ratio, low, high = (summary[f"{key}{suffix}"] for key in ("ratio", "ratio_min", "ratio_max"))
        cells.append(f"{ratio:.3f} ({low:.3f}-{high:.3f})")
    if "formula_mib" in summary:
        cells += [" / ".join(f"{summary[f'{side}_peak_mib']:.0f}" for side in "abc" if f"{side}_peak_mib" in summary)]
        cells.append(f"{summary['formula_mib']:.0f}")
    print("| " + " | ".join(str(cell) for cell in cells) + " |", flush=True)
    arch = "" if args.arch == "mlp" else f"_{args.arch}"
    suffix = "" if args.device == "cpu" and args.precision == "32-true" else f"_{args.device}_{args.precision}"
    out = Path(args.out) / f"{args.case}{arch}_zero{args.stage}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "sizes": S, **summary}, indent=2))


if __name__ == "__main__":
    main()
