"""What leaving parameters without a gradient untouched adds to a step, against the step itself, in one launch.

A stack of ``--layers`` Linear(``--width``) layers with tanh, Adam, half of the layers frozen
(``requires_grad_(False)``) once training starts, as a fine-tune that freezes a backbone mid-fit does: from then on
every step copies what the step may change of the frozen half on this rank (weights, master fragments, Adam's
moments) and puts it back after (``_compat.deepspeed.hold_still``). The copy and the restore are timed inside the
fit, against the ``training_step`` they are part of (``common.StepMeter``)::

    torchrun --nproc-per-node 2 benchmarks/untouched.py --stage 2

A step where every parameter got a gradient pays none of it (one emptiness test of a set per engine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from common import BARE, StepMeter
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._record import EngineRecord


class Stack(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)))
        self.automatic_optimization = False
        self.width = width

    def on_train_start(self) -> None:
        for layer in self.net[: len(self.net) // 2]:
            layer.requires_grad_(False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.net(batch).pow(2).mean())
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(self.steps * 8, self.width), batch_size=8)


def timed_holds(times: list[float]) -> Callable[[], None]:
    """Time each ``hold_still`` copy and its restore into ``times``; returns what undoes the patch."""
    original = EngineRecord.hold_untouched

    def hold_untouched(self: EngineRecord) -> Callable[[], None] | None:
        start = time.perf_counter()
        restore = original(self)
        copied = time.perf_counter() - start
        if restore is None:
            return None

        def timed_restore() -> None:
            begin = time.perf_counter()
            restore()
            times.append(copied + time.perf_counter() - begin)

        return timed_restore

    EngineRecord.hold_untouched = hold_untouched  # type: ignore[method-assign]
    return lambda: setattr(EngineRecord, "hold_untouched", original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    module = Stack(args.layers, args.width)
    module.steps = args.steps
    meter, holds = StepMeter(args.warmup), []
    undo = timed_holds(holds)
    try:
        devices = int(os.environ.get("WORLD_SIZE", "1"))
        strategy = MultiDeepSpeedStrategy(stage=args.stage)
        trainer = pl.Trainer(strategy=strategy, devices=devices, max_epochs=1, callbacks=[meter], **BARE)
        trainer.fit(module)
    finally:
        undo()
    holds = holds[args.warmup :]
    step, hold = statistics.median(meter.times), statistics.median(holds)
    if trainer.global_rank == 0:
        summary: dict[str, Any] = {"stage": args.stage, "layers": args.layers, "width": args.width}
        summary |= {"step_ms": round(step * 1e3, 3), "hold_ms": round(hold * 1e3, 3), "share": round(hold / step, 4)}
        print(summary, flush=True)


if __name__ == "__main__":
    main()
