"""Memory per rank: model-state bytes per engine against the ZeRO formula, and peak RSS of distillation.

Model states (``make bench`` runs every N and stage; ``--nproc-per-node`` is N)::

    torchrun --nproc-per-node 2 benchmarks/memory.py states --stage 2

builds the GAN engines of ``benchmarks/overhead.py`` in bf16 (the ZeRO paper's mixed precision) with Adam,
takes one step (so Adam's state exists), runs a second backward, and counts, per engine, the bytes of every
tensor DeepSpeed holds for it, each storage once: parameters (bf16 weights, this rank's partition at
ZeRO-3), gradients (``param.grad`` or the reduced partitions), optimizer state (fp32 master weights and
Adam's two moments), and communication buffers (buckets, reported apart). The ZeRO paper's formula with
Psi parameters, N ranks and K = 12 bytes of optimizer state per parameter: stage 1 ``4 Psi + 12 Psi / N``,
stage 2 ``2 Psi + 14 Psi / N``, stage 3 ``16 Psi / N``. Next to it, the same count from DeepSpeed's partition
layout: at stage 2 a rank's gradient buffer holds every parameter tensor its partition overlaps whole, so a
tensor cut by a partition boundary counts in full (``params_in_partition``). ``--hidden`` and ``--layers``
change the GAN's hidden width and depth (``--hidden 256 --layers 24``: many tensors, each small beside a
partition).

Peak resident memory of a distillation fit whose teacher is far larger than its student::

    torchrun --nproc-per-node 2 benchmarks/memory.py peak --teacher-stage 3

(``--teacher-stage 0``: the teacher replicated on every rank.) The teacher (``--teacher-layers`` hidden layers
of ``--teacher-hidden``) is built in ``configure_model``, so at ZeRO-3 it is created partitioned. A frozen
ZeRO-3 engine gathers each layer for its own forward and releases it after; ``--deepspeed-defaults`` gives the
teacher DeepSpeed's own live-parameter, reuse-distance and prefetch settings instead, which gather ahead.

Peak GPU memory (``torch.cuda.max_memory_allocated``) of the same distillation on the GPUs of one machine::

    torchrun --nproc-per-node 1 benchmarks/memory.py gpu-peak --teacher-stage 3 --student-hidden 16384 --offload

reports the fit's peak (setup, steps and teardown) and the peak while the teacher runs. With ``--offload`` the
teacher runs inside ``strategy.offloaded("student")``, so the ZeRO-2 student's weights, master copy and Adam moments
wait in host memory meanwhile; the peak while the teacher runs is read inside that block.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import warnings
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import BARE, formula
from overhead import S, discriminator_loss, gan_modules, generator_loss, mlp

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._compat.deepspeed import whole_numel
from lightning_multids._config import DEEPSPEED_ZERO3, engine_config
from lightning_multids._environment import keep_extensions_in_environment

CATEGORIES = ("parameters", "gradients", "optimizer", "buffers")


def _category(attribute: str) -> str | None:
    name = attribute.lower()
    if "ipg" in name or "bucket" in name:
        return "buffers"
    if "fp32" in name or "master" in name:
        return "optimizer"
    if "grad" in name:
        return "gradients"
    if "bit16" in name or "fp16" in name or "param" in name:
        return "parameters"
    return None


def _tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item, depth + 1)]
    return []


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of each category of tensor ``engine`` holds on this rank.

    Tensors are often views into one flat buffer (parameters into the flat bit16 group, gradient partitions
    into a contiguous buffer): each byte of a storage is counted once, and only the bytes some tensor views.
    A storage belongs to the first category that finds it.
    """
    spans: dict[int, tuple[str, set[tuple[int, int]]]] = {}

    def add(category: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or tensor.numel() == 0:  # meta: DeepSpeed's shape-only bookkeeping
            return
        key = tensor.untyped_storage().data_ptr()
        start = tensor.storage_offset() * tensor.element_size()
        spans.setdefault(key, (category, set()))[1].add((start, start + tensor.numel() * tensor.element_size()))

    for param in engine.module.parameters():
        add("parameters", param.ds_tensor if hasattr(param, "ds_tensor") else param.data)
        if param.grad is not None:
            add("gradients", param.grad)
    optimizer = engine.optimizer
    for state in optimizer.optimizer.state.values():  # the wrapped torch optimizer: Adam's moments
        for tensor in _tensors(state):
            if tensor.numel() > 1:
                add("optimizer", tensor)
    for attribute, value in vars(optimizer).items():
        category = _category(attribute)
        if category is not None:
            for tensor in _tensors(value):
                add(category, tensor)
    totals = dict.fromkeys(CATEGORIES, 0)
    for category, intervals in spans.values():
        totals[category] += _union_length(intervals)
    return totals


def _union_length(intervals: set[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for start, end in sorted(intervals):
        total += max(0, end - max(start, reach))
        reach = max(reach, end)
    return total


def layout(stage: int, engine: Any, psi: int, n: int) -> float:
    """Model-state bytes per rank as DeepSpeed lays them out: the formula, with ZeRO-2's gradient buffer.

    At stage 2 the buffer this rank reduces its gradients into holds each parameter that overlaps its
    partition whole (2 bytes per element in bf16), not just the overlapping ``psi / n`` elements.
    """
    if stage != 2:
        return formula(stage, psi, n)
    overlapping = sum(param.numel() for group in engine.optimizer.params_in_partition for param in group)
    return 2 * psi + 12 * psi / n + 2 * overlapping


def states(stage: int) -> None:
    """Print one table row per engine: measured model-state bytes per rank next to the formula."""
    torch.manual_seed(0)
    engines = {}
    for name, module in gan_modules().items():
        config = engine_config(
            name, stage=stage, default={}, override={}, precision="bf16-mixed", micro_batch_size=S["batch"]
        )
        engines[name], *_ = deepspeed.initialize(
            model=module, optimizer=torch.optim.Adam(module.parameters()), config=config
        )
    for _ in range(2):
        real = torch.rand(S["batch"], S["image"], dtype=torch.bfloat16)
        fake = engines["generator"](torch.randn(S["batch"], S["latent"], dtype=torch.bfloat16))
        engines["discriminator"].backward(discriminator_loss(engines["discriminator"], real, fake))
        measured = model_state_bytes(engines["discriminator"])  # after backward, before step: gradients held
        engines["discriminator"].step()
        engines["discriminator"].module.requires_grad_(False)
        engines["generator"].backward(generator_loss(engines["discriminator"].module, fake).float())
        measured_g = model_state_bytes(engines["generator"])
        engines["generator"].step()
        engines["discriminator"].module.requires_grad_(True)
    n = torch.distributed.get_world_size()
    if torch.distributed.get_rank() == 0:
        for name, result in (("generator", measured_g), ("discriminator", measured)):
            psi = whole_size(engines[name].module)
            total = result["parameters"] + result["gradients"] + result["optimizer"]
            expected, laid_out = formula(stage, psi, n), layout(stage, engines[name], psi, n)
            print(
                f"| {stage} | {n} | {name} | {psi / 1e6:.2f} M | {result['parameters'] / 2**20:.2f} | "
                f"{result['gradients'] / 2**20:.2f} | {result['optimizer'] / 2**20:.2f} | {total / 2**20:.2f} | "
                f"{expected / 2**20:.2f} | {total / expected - 1:+.1%} | {laid_out / 2**20:.2f} | "
                f"{total / laid_out - 1:+.1%} | {result['buffers'] / 2**20:.2f} |",
                flush=True,
            )


class BigTeacherDistill(pl.LightningModule):
    """A student distilled from a teacher far larger than itself, both built in ``configure_model``."""

    def __init__(self, teacher_hidden: int, teacher_layers: int, student_hidden: int = 64, offload: bool = False):
        super().__init__()
        self.teacher_sizes = [S["image"], *[teacher_hidden] * teacher_layers, S["classes"]]
        self.student_sizes = [S["image"], student_hidden, S["classes"]]
        self.offload = offload
        self.teacher_peaks: list[int] = []
        self.fit_peak = 0

    def configure_model(self) -> None:
        if not hasattr(self, "teacher"):
            self.teacher = mlp(*self.teacher_sizes)
            self.student = mlp(*self.student_sizes)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (images,) = batch
        asleep = self.trainer.strategy.offloaded("student") if self.offload else contextlib.nullcontext()  # type: ignore[attr-defined]
        with asleep, torch.no_grad():
            if images.is_cuda:  # the fit's peak so far, before the teacher's phase is measured alone
                self.fit_peak = max(self.fit_peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            targets = F.log_softmax(self.teacher(images).float(), -1)
            if images.is_cuda:
                self.teacher_peaks.append(torch.cuda.max_memory_allocated())
        student = F.log_softmax(self.student(images).float(), -1)
        return F.kl_div(student, targets, log_target=True, reduction="batchmean")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters())


def whole_size(module: torch.nn.Module) -> int:
    """The module's number of parameters, whole, also where ZeRO-3 holds partitions of them."""
    return sum(whole_numel(p) for p in module.parameters())


def fit_distillation(
    module: BigTeacherDistill, teacher: dict[str, Any], accelerator: str, precision: str
) -> pl.Trainer:
    """Five steps of ``module`` with a ZeRO-2 student and the teacher's ``zero_optimization`` section ``teacher``."""
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": {"zero_optimization": teacher}})
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=5,
        **BARE,
    )
    data = torch.utils.data.TensorDataset(torch.randn(S["batch"] * 20, S["image"]))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=S["batch"]))
    return trainer


def peak(teacher_stage: int, teacher_hidden: int, teacher_layers: int, deepspeed_defaults: bool) -> None:
    """Print this rank's peak resident memory after a short distillation fit."""
    module = BigTeacherDistill(teacher_hidden, teacher_layers)
    teacher = {"stage": teacher_stage, **(DEEPSPEED_ZERO3 if deepspeed_defaults else {})}
    trainer = fit_distillation(module, teacher, "cpu", "32-true")
    teacher_numel = whole_size(module.teacher)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    peaks = [torch.zeros(1) for _ in range(trainer.world_size)]
    torch.distributed.all_gather(peaks, torch.tensor([rss]))
    if trainer.is_global_zero:
        print(
            f"| {teacher_stage}{' (DeepSpeed defaults)' if deepspeed_defaults else ''} | "
            f"{teacher_layers} × {teacher_hidden} | "
            f"{teacher_numel / 1e6:.1f} M ({teacher_numel * 4 / 2**20:.0f} MiB fp32) | "
            f"{' / '.join(f'{p.item():.0f}' for p in peaks)} |",
            flush=True,
        )


def gpu_peak(args: argparse.Namespace) -> None:
    """Print this rank's peak GPU memory in a short distillation fit, and its peak while the teacher runs."""
    module = BigTeacherDistill(args.teacher_hidden, args.teacher_layers, args.student_hidden, args.offload)
    torch.cuda.reset_peak_memory_stats()
    trainer = fit_distillation(module, {"stage": args.teacher_stage}, "gpu", args.precision)
    fit_peak = max(module.fit_peak, torch.cuda.max_memory_allocated())  # setup, steps and teardown
    if trainer.is_global_zero:
        print(
            f"| {args.precision} | teacher ZeRO-{args.teacher_stage} | "
            f"{'student offloaded' if args.offload else 'student on the GPU'} | "
            f"teacher {whole_size(module.teacher) / 1e6:.0f} M, student {whole_size(module.student) / 1e6:.0f} M | "
            f"{fit_peak / 2**20:.0f} | {max(module.teacher_peaks) / 2**20:.0f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["states", "peak", "gpu-peak"])
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--teacher-stage", type=int, choices=[0, 3], default=3)
    parser.add_argument("--teacher-hidden", type=int, default=4096)
    parser.add_argument("--teacher-layers", type=int, default=2, help="hidden layers of the teacher")
    parser.add_argument(
        "--deepspeed-defaults", action="store_true", help="peak: DeepSpeed's prefetch and live-parameter settings"
    )
    parser.add_argument("--student-hidden", type=int, default=64, help="gpu-peak: the student's hidden width")
    parser.add_argument("--offload", action="store_true", help="gpu-peak: the teacher runs with the student offloaded")
    parser.add_argument("--precision", default="bf16-mixed", help="gpu-peak: the Trainer's precision")
    parser.add_argument("--hidden", type=int, default=S["hidden"], help="states: the GAN's hidden width")
    parser.add_argument("--layers", type=int, default=S["gan_layers"], help="states: hidden layers per GAN model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    S.update(hidden=args.hidden, gan_layers=args.layers)
    if args.mode == "states":
        keep_extensions_in_environment()  # as the strategy does: DeepSpeed builds its op in this venv
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        states(args.stage)
    elif args.mode == "gpu-peak":
        gpu_peak(args)
    else:
        peak(args.teacher_stage, args.teacher_hidden, args.teacher_layers, args.deepspeed_defaults)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
