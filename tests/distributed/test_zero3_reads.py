"""ZeRO-3 weight reads around the strategy's forward flag and attribute-read refusal, each as under DDP.

Each case trains 2 steps of SGD on 2 ranks under ``DDPStrategy`` and under the strategy at ZeRO-3 with every weight
partitioned, in manual optimization, calling the net's parts directly (as ``tests/distributed/test_external.py``).
A rank returns the largest difference from DDP's weights, or the error the strategy's fit raised as a string, so a
failure shows the error.

Each was a defect an adversarial review found (the first three in the strategy's first version of the flag):
- A forward pre-hook registered before the fit (the user's, torch's ``weight_norm``) reads a weight on an
  outermost call (a part called by ``training_step``): the flag's pre-hook now runs first.
- A forward pre-hook that raises before the strategy's (an input check the user catches) left the depth counter at
  -1 and every later such read refused for the rest of the fit.
- A read of a partitioned weight's metadata (``x.to(fc.weight.dtype)``) or ``hasattr(fc, "bias")`` outside every
  forward was refused (``hasattr`` raised ``RuntimeError``); the partition answers as the whole weight would.
- A DPO-style ``parameters(recurse)`` override that leaves the frozen reference out stopped inside DeepSpeed with
  ``AttributeError: 'Parameter' object has no attribute 'ds_numel'``; it is refused at setup, naming ZeRO-0/1/2.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

ALL_PARTITIONED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
QUIET = {"use_distributed_sampler": False, "enable_checkpointing": False}


def codebook_scale(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    """A user's forward pre-hook that reads a weight of the module it runs on."""
    return (args[0] / module.embedding.weight.norm(),)


class Quantizer(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.embedding = nn.Embedding(6, 4)
        self.boom = False
        if case == "pre_hook_read":
            self.register_forward_pre_hook(codebook_scale)
        if case == "pre_hook_raises":
            self.register_forward_pre_hook(self.check)

    def check(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if self.boom:
            raise ValueError("input refused")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        codes = self.embedding.weight
        distances = z.pow(2).sum(1, keepdim=True) - 2 * z @ codes.t() + codes.pow(2).sum(1)
        quantized = self.embedding(distances.argmin(1))
        return z + (quantized - z).detach() + (quantized - z.detach()).pow(2).mean()


class Net(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.enc = nn.Linear(5, 4)
        self.quant = Quantizer(case)
        self.head = nn.Linear(4, 1)


class Quantized(pl.LightningModule):
    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.automatic_optimization = False
        self.net = Net(case)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        net, x = self.net, batch[:, :5]
        if self.case == "pre_hook_raises" and batch_idx == 0:
            net.quant.boom = True
            with pytest.raises(ValueError, match="input refused"):
                net.quant(torch.zeros(2, 4))
            net.quant.boom = False
        if self.case == "metadata":
            x = x.to(net.enc.weight.dtype)
            assert hasattr(net.enc, "bias")
        loss = net.head(net.quant(net.enc(x))).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, torch.randn(16, 5, generator=torch.Generator().manual_seed(1)))


class DPO(nn.Module):
    """x-transformers' DPO layout, with the override the refusal asks for: ``parameters`` takes ``recurse``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.policy = model
        self.ref = copy.deepcopy(model).requires_grad_(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.policy.parameters(recurse=recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        policy = self.policy(x)
        with torch.no_grad():
            reference = self.ref(x)
        return (policy - reference).pow(2).mean() + policy.mean()


class WithDPO(pl.LightningModule):
    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.dpo = DPO(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.dpo(batch[:, :5]))
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.dpo.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, torch.randn(16, 5, generator=torch.Generator().manual_seed(1)))


def difference_from_ddp(case: str) -> float | str:
    """The largest difference of the ZeRO-3 fit's weights from DDP's, or the ZeRO-3 fit's error as a string."""
    make = WithDPO if case == "dpo" else Quantized
    ddp = make(case)
    cpu_trainer(DDPStrategy(process_group_backend="gloo"), **QUIET).fit(ddp)
    expected = {key: value.detach().clone() for key, value in ddp.state_dict().items()}
    at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
    strategy = MultiDeepSpeedStrategy(stage=3, config=ALL_PARTITIONED)
    try:
        cpu_trainer(strategy, callbacks=[at_end], **QUIET).fit(make(case))
    except Exception as error:  # noqa: BLE001 (the test shows it)
        return f"{type(error).__name__}: {error}"
    return max((at_end.value[key] - value).abs().max().item() for key, value in expected.items())


def test_a_forward_pre_hook_reading_a_weight_matches_ddp() -> None:
    assert on_ranks(difference_from_ddp, "pre_hook_read")[0] == 0.0


def test_an_exception_in_a_forward_pre_hook_leaves_later_forwards_as_ddp() -> None:
    assert on_ranks(difference_from_ddp, "pre_hook_raises")[0] == 0.0


def test_a_weights_dtype_and_hasattr_outside_forward_are_answered() -> None:
    assert on_ranks(difference_from_ddp, "metadata")[0] == 0.0


def test_the_parameters_override_remedy_trains_or_is_refused_by_the_strategy() -> None:
    found = on_ranks(difference_from_ddp, "dpo")[0]
    assert found == 0.0 or (isinstance(found, str) and found.startswith("ValueError") and "'dpo'" in found), found
