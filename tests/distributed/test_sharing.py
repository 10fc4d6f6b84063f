"""Layers shared between submodules: what trains as plain PyTorch, and what is refused at setup (2 ranks).

Each rank returns, per scenario, the largest difference from plain PyTorch, or the error raised:

* ``frozen_encoder_zeroA_B``: two trained heads ``a`` and ``b`` on one frozen layer (``requires_grad=False``), at
  ZeRO-A and ZeRO-B: nothing partitions or freezes it apart, so it trains as plain PyTorch does.
* ``tied_in_configure_model``: a plain ``probe`` whose weight is a ZeRO-3 discriminator's, both built under
  ``zero.Init`` in ``configure_model``: made whole, the probe would hold a copy, so it is refused.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

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


def fit(module: pl.LightningModule, stages: dict[str, int]) -> dict[str, Any] | str:
    """The consolidated weights after a fit, or the message of the ValueError it raised (on one line)."""
    configs = {n: {"zero_optimization": {"stage": s}} for n, s in stages.items()}
    strategy = MultiDeepSpeedStrategy(stage=0, engine_configs=configs)
    try:
        cpu_trainer(strategy, enable_checkpointing=False).fit(module)
    except ValueError as error:
        return str(error).replace("\n", " ")
    return strategy.consolidated_state_dict()


def fit_each_scenario() -> dict[str, str]:
    """On each rank: what each scenario says, by name: how far it trained from plain PyTorch, or its error."""
    results = {}
    expected = heads_reference()
    for a, b in ((2, 2), (0, 1), (3, 0)):
        name = f"frozen_encoder_zero{a}_{b}"
        got = fit(Heads(), {"a": a, "b": b})
        if isinstance(got, str):
            results[name] = got
        else:
            diff = max((got[k].float() - v).abs().max().item() for k, v in expected.items())
            results[name] = f"trained, {diff:.3e} from plain PyTorch"
    tied = fit(Tied(), {"discriminator": 3})
    if isinstance(tied, str):
        results["tied_in_configure_model"] = tied
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return on_ranks(fit_each_scenario, timeout=300)


@pytest.mark.parametrize("stages", ["2_2", "0_1"])
def test_two_trained_heads_on_one_frozen_layer_train_as_plain_pytorch(results: list[dict], stages: str) -> None:
    for rank, messages in enumerate(results):
        said = messages[f"frozen_encoder_zero{stages}"]
        found = re.fullmatch(r"trained, (\S+) from plain PyTorch", said)
        assert found and float(found.group(1)) <= 1e-6, f"rank {rank}: {said}"


def test_a_frozen_layer_shared_with_a_zero3_engine_is_refused(results: list[dict]) -> None:
    for messages in results:
        assert re.search(r"engines 'a' and 'b' share a parameter", messages["frozen_encoder_zero3_0"])


def test_a_layer_tied_in_configure_model_to_a_zero3_engine_is_refused(results: list[dict]) -> None:
    for messages in results:
        assert re.search(
            r"submodule 'probe' shares a parameter with the ZeRO-3 submodule 'discriminator'.*copy that does not train",
            messages["tied_in_configure_model"],
        ), messages["tied_in_configure_model"]
