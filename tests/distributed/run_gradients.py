"""Per-rank script: ``strategy.full_gradients(name)`` between backward and step, at one ZeRO stage and precision.

Usage: run_gradients.py OUT STAGE PRECISION [CONFIG_JSON [MICRO]]

The ``shared`` pattern's first backward (one loss over both engines, so the discriminator's gradients come
from two uses); rank 0 saves what ``full_gradients`` gives for each engine after ``manual_backward``, what it
gives in the module's ``on_after_backward`` hook and in a callback's (keys prefixed ``hook.`` and ``callback.``),
and its unknown-name error. With MICRO, the loss is backpropagated as MICRO backwards of ``loss / MICRO``.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")


class Reader(pl.LightningModule):
    def __init__(self, micro: int = 1) -> None:
        super().__init__()
        self.micro = micro
        self.generator, self.discriminator = patterns.make_modules()
        self.read: dict[str, Any] = {}

    def on_after_backward(self) -> None:
        if self.trainer.global_step == 0:
            self.read.update(read_all(self.trainer.strategy, "hook."))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real, z = patterns.split(batch)
        if batch_idx == 0:  # no backward has reached the engines yet: zeros
            self.read.update(read_all(self.trainer.strategy, "before."))
        for _ in range(self.micro):
            loss = (self.discriminator(self.generator(z)) - 0.3).pow(2).mean() + self.discriminator(real).pow(2).mean()
            self.manual_backward(loss / self.micro)
        if batch_idx == 0:
            strategy = self.trainer.strategy
            self.read.update(read_all(strategy, ""))
            try:
                strategy.full_gradients("critic")
            except ValueError as error:
                self.read["error"] = str(error)
        opt_g.step()
        opt_d.step()
        opt_g.zero_grad()
        opt_d.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("sgd", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(2))


def read_all(strategy: Any, prefix: str) -> dict[str, Any]:
    read: dict[str, Any] = {}
    for name in ("generator", "discriminator"):
        try:
            read.update({f"{prefix}{name}.{k}": v.clone() for k, v in strategy.full_gradients(name).items()})
        except NotImplementedError as error:
            read["refused"] = str(error)
    return read


class CallbackReader(pl.Callback):
    def __init__(self, into: dict[str, Any]) -> None:
        self.into = into

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0:
            self.into.update(read_all(trainer.strategy, "callback."))


def main() -> None:
    out, stage, precision, *config = sys.argv[1:]
    module = Reader(int(config[1]) if len(config) > 1 else 1)
    trainer = cpu_trainer(
        MultiDeepSpeedStrategy(stage=int(stage), config=json.loads(config[0]) if config else None),
        precision=precision,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=[CallbackReader(module.read)],
    )
    trainer.fit(module)
    if trainer.global_rank == 0:
        torch.save(module.read, out)


if __name__ == "__main__":
    main()
    finish()
