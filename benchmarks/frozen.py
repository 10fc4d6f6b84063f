"""Peak memory and step time of distillation from a frozen teacher: two engines against one.

    torchrun --nproc-per-node N benchmarks/frozen.py --stage 2|3 [--before]

One LightningModule (a frozen MLP teacher far larger than its MLP student, both built in ``configure_model``,
so that at ZeRO-3 they are created partitioned) is trained on each side, bf16, Adam on the student:

* A: ``MultiDeepSpeedStrategy``: a frozen engine for the teacher and an engine for the student, both at
  ``--stage`` (a frozen engine at ZeRO-1/2 runs replicated);
* B: one raw DeepSpeed engine over the whole module, the teacher frozen inside it, at ``--stage`` with
  DeepSpeed's defaults (the loop Lightning's ``DeepSpeedStrategy`` runs, without Lightning);
* S: B with its reduce bucket sized to the student's gradients, as A sizes its student's: what remains is what
  two engines cost against one;
* C, on a GPU: Lightning's ``DeepSpeedStrategy`` over the same LightningModule (its defaults).

Step time: ``--rounds`` rounds of each side, in alternating order, ``--steps`` timed steps each after 2 warm-up
steps; the ratio A/B (and A/C) is the median of the per-round ratios. Peak memory: one more fit of each side, 3
steps. On a GPU it is ``torch.cuda.max_memory_allocated`` above what was allocated before the fit. On a CPU it
is the same figure from torch's profiler: the most bytes held by tensors at once (its allocation events'
running total), which counts a buffer that is allocated and never touched, as a GPU would, where resident memory
does not. ``--profile K`` lists, for each side, the K places in the code that allocated the most of what is
alive at its peak (CPU only).

``--before`` gives A what it had before frozen engines were made lean and buckets sized: DeepSpeed's ZeRO-3
prefetch, live-parameter and reuse-distance defaults on the teacher, and its 5e8-element reduce bucket on the
student.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import BARE, StepMeter, release_memory, summarize, synchronize
from lightning.pytorch.strategies import DeepSpeedStrategy
from overhead import mlp
from torch.profiler import ProfilerActivity, profile

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._compat.deepspeed import release_engine
from lightning_multids._config import DEEPSPEED_REDUCE_BUCKET, DEEPSPEED_ZERO3, engine_config, merge
from lightning_multids._environment import keep_extensions_in_environment

SIZES = {  # hidden width x hidden layers of teacher and student, batch per process
    "cpu": {"teacher": (2048, 12), "student": (512, 2), "batch": 64},  # 47.8 M and 0.67 M parameters
    "gpu": {"teacher": (4096, 22), "student": (4096, 3), "batch": 256},  # 355.6 M and 36.8 M
}
S: dict[str, Any] = dict(SIZES["cpu"], image=784, classes=10)


def student_module() -> torch.nn.Sequential:
    width, layers = S["student"]
    return mlp(S["image"], *[width] * layers, S["classes"])


class Distill(pl.LightningModule):
    """A student matched to a frozen teacher's log-probabilities (KL divergence)."""

    def configure_model(self) -> None:
        if hasattr(self, "teacher"):
            return
        width, layers = S["teacher"]
        self.teacher = mlp(S["image"], *[width] * layers, S["classes"])
        self.teacher.requires_grad_(False)
        self.student = student_module()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            targets = F.log_softmax(self.teacher(images).float(), -1)
        logits = self.student(images).float()
        return F.kl_div(F.log_softmax(logits, -1), targets, log_target=True, reduction="batchmean")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters())


def config(stage: int, device: str) -> dict[str, Any]:
    """The DeepSpeed config of one engine at ``stage`` in bf16, as the strategy builds it."""
    return engine_config(
        "module", stage=stage, default={}, override={}, precision="bf16-mixed", micro_batch_size=S["batch"],
        device_type=device,
    )  # fmt: skip


def fit(strategy: Any, data: list[torch.Tensor], steps: int, device: str, meter: StepMeter) -> None:
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        use_distributed_sampler=False,
        callbacks=[meter],
        **BARE,
    )
    trainer.fit(Distill(), torch.utils.data.DataLoader(data, batch_size=None))


def side_a(stage: int, before: bool, data: list[torch.Tensor], steps: int, device: str, meter: StepMeter) -> None:
    """Two engines under MultiDeepSpeedStrategy."""
    teacher: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    student: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if before:
        teacher["zero_optimization"].update(DEEPSPEED_ZERO3)
        student["zero_optimization"]["reduce_bucket_size"] = DEEPSPEED_REDUCE_BUCKET
    strategy = MultiDeepSpeedStrategy(engine_configs={"teacher": teacher, "student": student})
    fit(strategy, data, steps, device, meter)


def side_b(stage: int, before: bool, data: list[torch.Tensor], steps: int, device: str, meter: StepMeter) -> None:
    """One raw DeepSpeed engine over the whole module; ``meter`` gets the same per-step times."""
    one_engine(config(stage, device), data, steps, meter)


def side_s(stage: int, before: bool, data: list[torch.Tensor], steps: int, device: str, meter: StepMeter) -> None:
    """B with a reduce bucket of the student's size."""
    student = sum(p.numel() for p in student_module().parameters())
    one_engine(merge(config(stage, device), {"zero_optimization": {"reduce_bucket_size": student}}), data, steps, meter)


def one_engine(settings: dict[str, Any], data: list[torch.Tensor], steps: int, meter: StepMeter) -> None:
    """Train the whole module as one engine with ``settings`` for ``steps`` steps, timing each after warm-up."""
    stage = settings["zero_optimization"]["stage"]
    module = Distill()
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=settings):
            module.configure_model()
    else:
        module.configure_model()
    optimizer = torch.optim.Adam(module.student.parameters())
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=settings)
    for index, images in enumerate(data[:steps]):
        synchronize()
        start = time.perf_counter()
        engine.backward(engine(images.to(engine.device, torch.bfloat16)))
        engine.step()
        synchronize()
        if index >= meter.warmup:
            meter.times.append(time.perf_counter() - start)
    release_engine(engine)


def side_c(stage: int, before: bool, data: list[torch.Tensor], steps: int, device: str, meter: StepMeter) -> None:
    """Lightning's DeepSpeedStrategy: one engine, its own defaults (GPU only: it refuses a CPU)."""
    # Lightning reads the batch size off the loader's sampler, which a loader of ready batches lacks: name it.
    fit(DeepSpeedStrategy(stage=stage, logging_batch_size_per_gpu=S["batch"]), data, steps, device, meter)


SIDES: dict[str, Callable[..., None]] = {"a": side_a, "b": side_b, "s": side_s, "c": side_c}


@contextmanager
def peak_bytes(device: str, live: list[tuple[int, str]] | None = None) -> Iterator[list[int]]:
    """Yield a list that holds, on exit, the most bytes allocated at once inside the block above its start.

    On a CPU, ``live`` (if given) receives the bytes alive at that moment by the innermost Python frame outside
    torch that allocated them, largest first.
    """
    result: list[int] = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield result
        result.append(torch.cuda.max_memory_allocated() - start)
        return
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=live is not None) as prof:
        yield result
    events = sorted(_allocations(prof), key=lambda node: node.start_time_ns)
    totals = [event.extra_fields.total_allocated for event in events]
    result.append(max(totals, default=0))
    if live is not None and events:
        live.extend(_live_at(events, totals.index(result[0])))


def _live_at(events: list[Any], peak: int) -> list[tuple[int, str]]:
    """The bytes of ``events[: peak + 1]`` not freed by then, summed by where they were allocated, largest first."""
    alive: dict[int, tuple[int, str]] = {}
    for node in events[: peak + 1]:
        fields = node.extra_fields
        if fields.alloc_size > 0:
            alive[fields.ptr] = (fields.alloc_size, _caller(node))
        else:
            alive.pop(fields.ptr, None)
    by_caller: dict[str, int] = {}
    for size, caller in alive.values():
        by_caller[caller] = by_caller.get(caller, 0) + size
    return sorted(((size, caller) for caller, size in by_caller.items()), reverse=True)


def _caller(node: Any) -> str:
    from torch._C._profiler import _EventType

    while node is not None:
        if node.tag == _EventType.PyCall and "torch/" not in node.name:
            return str(node.name)
        node = node.parent
    return "?"


def _allocations(prof: profile) -> Iterator[Any]:
    from torch._C._profiler import _EventType

    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            yield node
        stack.extend(node.children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=[2, 3], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--before", action="store_true", help="A as before frozen engines were made lean")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--profile", type=int, default=0, help="CPU: where what is alive at each peak came from")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    S.update(SIZES["gpu" if args.device == "cuda" else "cpu"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        keep_extensions_in_environment()  # as the strategy does: DeepSpeed builds its op in this venv
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    sides = "absc" if args.device == "cuda" else "abs"
    rank = int(os.environ.get("RANK", "0"))
    generator = torch.Generator().manual_seed(rank)
    data = [torch.randn(S["batch"], S["image"], generator=generator) for _ in range(2 + args.steps)]
    times: dict[str, list[list[float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            meter = StepMeter(warmup=2)
            SIDES[side](args.stage, args.before, data, 2 + args.steps, args.device, meter)
            times[side].append(meter.times)
            release_memory()
    peaks = {}
    for side in sides:
        live: list[tuple[int, str]] | None = [] if args.profile else None
        with peak_bytes(args.device, live) as peak:
            SIDES[side](args.stage, args.before, data, 3, args.device, StepMeter(warmup=3))
        peaks[side] = peak[0]
        release_memory()
        if live and rank == 0:
            print(f"side {side}: {peak[0] / 2**20:.0f} MiB at the peak, allocated by:", flush=True)
            for size, caller in live[: args.profile]:
                print(f"  {size / 2**20:8.1f} MiB  {caller}", flush=True)
    report(args, times, peaks)


def report(args: argparse.Namespace, times: dict[str, list[list[float]]], peaks: dict[str, int]) -> None:
    """Print one table row on rank 0: each side's peak per rank (MiB) and step time, and the ratios to A."""
    world = torch.distributed.get_world_size()
    gathered: list[dict[str, int]] = [{} for _ in range(world)]
    torch.distributed.all_gather_object(gathered, peaks)
    if torch.distributed.get_rank() != 0:
        return
    cells = [str(args.stage), str(world), "before" if args.before else "now"]
    for side in times:
        cells.append(" / ".join(f"{rank_peaks[side] / 2**20:.0f}" for rank_peaks in gathered))
        cells.append(f"{1e3 * statistics.median(t for run in times[side] for t in run):.1f}")
    for other in [side for side in times if side != "a"]:
        summary = summarize(times["a"], times[other])
        cells.append(f"{summary['ratio']:.3f} ({summary['ratio_min']:.3f}-{summary['ratio_max']:.3f})")
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
