"""Per-rank script: build a large ZeRO-3 teacher in configure_model and report this rank's peak memory growth.

Usage: run_memory.py OUT
"""

from __future__ import annotations

import sys
import threading
import warnings

import lightning.pytorch as pl
import psutil
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish

warnings.filterwarnings("ignore")
WIDTH, LAYERS = 1024, 16  # about 16.8M parameters, 67 MB in fp32


class PeakRSS:
    """Sample this process's resident memory every millisecond while active; keep the peak."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRSS:
        self.start = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


class BigTeacher(pl.LightningModule):
    def configure_model(self) -> None:
        with PeakRSS() as memory:
            self.teacher = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
            self.student = nn.Linear(WIDTH, WIDTH)
        self.growth = memory.peak - memory.start

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch[:, :1].expand(-1, WIDTH).contiguous()
        return (self.student(x) - self.teacher(x)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(1), batch_size=4)


def main() -> None:
    (out,) = sys.argv[1:]
    module = BigTeacher()
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": {"zero_optimization": {"stage": 3}}})
    trainer = cpu_trainer(strategy, max_steps=1, enable_checkpointing=False)
    trainer.fit(module)
    teacher_bytes = sum(p.ds_numel for p in module.teacher.parameters()) * 4
    local_bytes = sum(p.ds_tensor.numel() for p in module.teacher.parameters()) * 4
    result = {"growth": module.growth, "teacher_bytes": teacher_bytes, "local_bytes": local_bytes}
    torch.save(result, f"{out}.{trainer.global_rank}")


if __name__ == "__main__":
    main()
    finish()
