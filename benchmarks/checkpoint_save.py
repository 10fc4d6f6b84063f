"""Time and peak host memory of a checkpoint save, per format, against ``DDPStrategy``'s file in the same launch.

A LightningModule of two submodules, ``generator`` and ``discriminator``, each ``--layers`` ``Linear(--width,
--width)`` (the defaults: 8 layers of 2048 x 2048 in all, 134 MB of fp32 weights), each trained by its own Adam, is
fitted for 2 steps under ``DDPStrategy`` and under ``MultiDeepSpeedStrategy(stage=S)`` for each ``--stages``; then
``trainer.save_checkpoint`` runs ``--rounds`` times per format: DDP's one file; the strategy's ``"directory"`` and
``"file"`` (``checkpoint_format``, switched on the same strategy between saves), in an order that alternates every
round. Each save is timed on rank 0 from before the call to after a barrier behind it (every rank done), and a thread
samples rank 0's resident memory every 5 ms during it: the peak above the memory before the call is what the save
held. Printed per side: the median seconds and peak MiB over the rounds (min-max), the size on disk, and the
median per-round ratio of seconds against DDP's save of the same round::

    torchrun --nproc-per-node 2 benchmarks/checkpoint_save.py --stages 0 2 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import psutil
import torch
from common import BARE
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy


class TwoModels(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers // 2)))
        self.discriminator = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers - layers // 2)))
        self.width = width

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optimizers = self.optimizers()
        self.manual_backward(self.generator(batch).pow(2).mean() + self.discriminator(batch).pow(2).mean())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(m.parameters(), lr=1e-4) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, self.width), batch_size=2)


class PeakMemory:
    """Rank 0's resident memory sampled every 5 ms on a thread: the peak above where it was at the start."""

    def __init__(self) -> None:
        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.start = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return max(0, self.peak - self.start) / 2**20


def size_on_disk(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def timed_save(trainer: pl.Trainer, path: Path) -> tuple[float, float, float]:
    """Seconds, peak MiB above the start on rank 0, and MiB on disk, of one ``save_checkpoint``."""
    trainer.strategy.barrier()
    memory = PeakMemory() if trainer.is_global_zero else None
    start = time.perf_counter()
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    seconds = time.perf_counter() - start
    peak = memory.stop() if memory is not None else 0.0
    size = size_on_disk(path) if trainer.is_global_zero else 0.0
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return seconds, peak, size


def fitted(strategy: pl.strategies.Strategy, args: argparse.Namespace) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, **BARE)
    trainer.fit(TwoModels(args.layers, args.width))
    return trainer


def rounds(saves: dict[str, Callable[[Path], tuple[float, float, float]]], folder: Path, count: int) -> dict:
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in saves}
    for round_ in range(count):
        order = list(saves) if round_ % 2 == 0 else list(reversed(saves))
        for name in order:
            results[name].append(saves[name](folder / f"{name}-{round_}.ckpt"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    folder = Path(os.environ.get("CHECKPOINT_BENCH_DIR") or tempfile.gettempdir()) / "checkpoint_save_bench"
    folder.mkdir(parents=True, exist_ok=True)
    ddp = fitted(DDPStrategy(), args)
    ddp_rounds = rounds({"ddp": lambda path: timed_save(ddp, path)}, folder, args.rounds)["ddp"]
    results = {"DDPStrategy (one file)": ddp_rounds}
    for stage in args.stages:
        strategy = MultiDeepSpeedStrategy(stage=stage)
        trainer = fitted(strategy, args)

        def save_as(form: str, path: Path, strategy: MultiDeepSpeedStrategy = strategy, trainer: pl.Trainer = trainer):
            strategy.checkpoint_format = form
            return timed_save(trainer, path)

        formats = {form: (lambda path, form=form: save_as(form, path)) for form in ("directory", "file")}
        for form, values in rounds(formats, folder, args.rounds).items():
            results[f"ZeRO-{stage} {form}"] = values
    if ddp.is_global_zero:
        report(results, ddp_rounds, args)


Saves = list[tuple[float, float, float]]
"""Each round's seconds, peak MiB and MiB on disk."""


def report(results: dict[str, Saves], ddp: Saves, args: argparse.Namespace) -> None:
    weights = args.layers * (args.width + 1) * args.width
    print(f"{args.layers} x Linear({args.width}, {args.width}): {4 * weights / 2**20:.0f} MiB of fp32 weights, Adam")
    print("| save | seconds | against DDP's | peak MiB above the start (rank 0) | MiB on disk |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        seconds, peaks, sizes = zip(*values, strict=True)
        ratios = [s / d[0] for s, d in zip(seconds, ddp, strict=True)]
        print(
            f"| {name} | {statistics.median(seconds):.2f} ({min(seconds):.2f}-{max(seconds):.2f}) "
            f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {statistics.median(peaks):.0f} ({min(peaks):.0f}-{max(peaks):.0f}) | {statistics.median(sizes):.0f} |"
        )


if __name__ == "__main__":
    main()
