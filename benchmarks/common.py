"""What the benchmark scripts share: a step timer for Lightning fits, and summaries of A/B rounds."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_multids.utilities import ReductionCounter

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `examples` from a script launched as `torchrun benchmarks/x.py`


BARE = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
"""Trainer options of every benchmark fit: nothing written, nothing printed per step."""


class StepMeter(pl.Callback):
    """Wall time of each ``training_step`` (and, with ``count=True``, each engine's reductions), after warm-up.

    The timer starts when Lightning hands the batch to the module and stops when the step returns: the
    data loader is not timed, as in the hand-written loops it is compared with. On a GPU both ends wait for
    the queued kernels (:func:`synchronize`).
    """

    def __init__(self, warmup: int, count: bool = False) -> None:
        self.warmup = warmup
        self.count = count
        self.times: list[float] = []
        self.reductions: list[dict[str, int]] = []
        self._batches = 0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.count:
            self.counter = ReductionCounter(trainer.strategy.engines).__enter__()
        synchronize()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        synchronize()
        elapsed = time.perf_counter() - self.start
        if self.count:
            self.counter.__exit__(None, None, None)
        self._batches += 1
        if self._batches > self.warmup:
            self.times.append(elapsed)
            if self.count:
                self.reductions.append(self.counter.counts)


def synchronize() -> None:
    """Wait for the kernels queued on this process's GPU, if it has one (a no-op on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def release_memory() -> None:
    """Free what the last run left (its engines), so that the next one starts from the same memory."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def formula(stage: int, psi: int, n: int) -> float:
    """Model-state bytes per rank from the ZeRO paper (fp16/bf16 weights and gradients, K = 12), stage 0 to 3."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def summarize(a_times: list[list[float]], b_times: list[list[float]]) -> dict[str, float]:
    """Median step time (ms) of A and of B over all rounds, and the median and range of per-round A/B ratios."""
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(a_times, b_times, strict=True)]
    return {
        "a_ms": 1e3 * statistics.median(t for run in a_times for t in run),
        "b_ms": 1e3 * statistics.median(t for run in b_times for t in run),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
