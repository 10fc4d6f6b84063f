"""Per-rank script: layers shared between submodules that sharing allows, and one it must refuse.

Usage: run_sharing.py. Prints ``RESULT name: ...`` per scenario: the largest difference from plain PyTorch, or the
error raised.

* ``frozen_encoder_zeroA_B``: two trained heads ``a`` and ``b`` on one frozen layer (``requires_grad=False``), at
  ZeRO-A and ZeRO-B: nothing partitions or freezes it apart, so it trains as plain PyTorch does.
* ``tied_in_configure_model``: a plain ``probe`` whose weight is a ZeRO-3 discriminator's, both built under
  ``zero.Init`` in ``configure_model``: made whole, the probe would hold a copy, so it is refused.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
DATA = patterns.make_batches(3)


def heads() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = nn.Linear(6, 6)
    base.requires_grad_(False)
    return {"a": nn.Sequential(base, nn.Tanh(), nn.Linear(6, 1)), "b": nn.Sequential(base, nn.Linear(6, 1))}


def heads_loss(modules: dict[str, nn.Module], batch: torch.Tensor) -> torch.Tensor:
    real, _ = patterns.split(batch)
    return modules["a"](real).pow(2).mean() + modules["b"](real).mean()


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class Heads(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = heads().values()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.manual_backward(heads_loss({"a": self.a, "b": self.b}, batch))
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(trainable(m), lr=0.2) for m in (self.a, self.b)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, DATA)


def heads_reference() -> dict[str, torch.Tensor]:
    modules = heads()
    optimizers = [torch.optim.SGD(trainable(m), lr=0.2) for m in modules.values()]
    for step in range(3):
        heads_loss(modules, DATA[8 * step : 8 * step + 8]).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return {f"{n}.{k}": v for n, m in modules.items() for k, v in m.state_dict().items()}


class Tied(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_model(self) -> None:
        self.generator, self.discriminator = patterns.make_modules()
        self.probe = nn.Linear(6, 16)
        self.probe.weight = self.discriminator[0].weight

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        raise AssertionError("setup should have refused the tied probe")

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(m.parameters(), lr=0.2) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, DATA)


def fit(name: str, module: pl.LightningModule, stages: dict[str, int]) -> dict[str, Any] | None:
    configs = {n: {"zero_optimization": {"stage": s}} for n, s in stages.items()}
    strategy = MultiDeepSpeedStrategy(stage=0, engine_configs=configs)
    try:
        cpu_trainer(strategy, enable_checkpointing=False).fit(module)
    except ValueError as error:
        print(f"RESULT {name}: {error}".replace("\n", " "), flush=True)
        return None
    return strategy.consolidated_state_dict()


def main() -> None:
    expected = heads_reference()
    for a, b in ((2, 2), (0, 1), (3, 0)):
        name = f"frozen_encoder_zero{a}_{b}"
        got = fit(name, Heads(), {"a": a, "b": b})
        if got is not None:
            diff = max((got[k].float() - v).abs().max().item() for k, v in expected.items())
            print(f"RESULT {name}: trained, {diff:.3e} from plain PyTorch", flush=True)
    fit("tied_in_configure_model", Tied(), {"discriminator": 3})


if __name__ == "__main__":
    main()
    finish()
