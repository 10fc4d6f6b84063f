"""ZeRO-3: a weight read outside its owner's forward, in a submodule that user code calls itself, matches DDP.

taming-transformers' ``VectorQuantizer2`` measures distances to ``self.embedding.weight`` before it calls
``self.embedding(...)``. At ZeRO-3 that weight is an empty partition there unless DeepSpeed gathers it as an
external parameter, which it does only inside a forward it knows of. Two layouts the user writes: the quantizer a
child of an engine's submodule, called directly (``self.net.quant(...)``), and the quantizer one part of an engine
over several submodules (one optimizer over ``enc``, ``quant`` and ``head``). Before the strategy set DeepSpeed's
forward flag around such calls, both stopped on the first step with torch's ``RuntimeError: size mismatch`` from the
user's distance computation.

Beside them, what an adversarial review of that flag found (each a defect of its first version):
- a forward pre-hook registered before the fit (the user's, torch's ``weight_norm``) reading a weight on an
  outermost call was refused: the flag's pre-hook now runs first;
- a forward pre-hook that raised before the strategy's (an input check the user catches) left the depth counter at
  -1, and every later such read was refused for the rest of the fit;
- a read of a partitioned weight's ``dtype``, or ``hasattr(fc, "bias")``, outside every forward was refused
  (``hasattr`` raised ``RuntimeError``): the partition answers as the whole weight would;
- a DPO-style ``parameters(recurse)`` override that leaves the frozen reference out stopped inside DeepSpeed with
  ``AttributeError: 'Parameter' object has no attribute 'ds_numel'``: it is refused at setup, naming ZeRO-0/1/2.

Each case trains 2 steps of SGD on 2 ranks under ``DDPStrategy`` and under the strategy at ZeRO-3 with every weight
partitioned, all in one launch; a rank returns, per case, the largest difference from DDP's weights or the error
the strategy's fit raised.
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
CASES = ("child", "joined", "pre_hook_read", "pre_hook_raises", "metadata", "dpo")


def codebook_scale(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    """A user's forward pre-hook that reads a weight of the module it runs on."""
    return (args[0] / module.embedding.weight.norm(),)


class Quantizer(nn.Module):
    """Nearest-code quantization with a straight-through estimator and a codebook loss, as VQ-VAEs write it."""

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


def made_data() -> torch.Tensor:
    return torch.randn(16, 5, generator=torch.Generator().manual_seed(1))


class Quantized(pl.LightningModule):
    """``case`` "joined": one optimizer over three parts; otherwise ``net`` one engine, its children called directly."""

    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.automatic_optimization = False
        if case == "joined":
            self.enc, self.quant, self.head = Net(case).children()
        else:
            self.net = Net(case)
        self.other = nn.Linear(5, 1)

    def parts(self) -> nn.Module:
        return self if self.case == "joined" else self.net

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt, opt_other = self.optimizers()
        parts, x = self.parts(), batch[:, :5]
        if self.case == "pre_hook_raises" and batch_idx == 0:
            parts.quant.boom = True
            with pytest.raises(ValueError, match="input refused"):
                parts.quant(torch.zeros(2, 4))
            parts.quant.boom = False
        if self.case == "metadata":
            x = x.to(parts.enc.weight.dtype)
            assert hasattr(parts.enc, "bias")
        loss = parts.head(parts.quant(parts.enc(x))).pow(2).mean() + self.other(x).pow(2).mean()
        opt.zero_grad()
        opt_other.zero_grad()
        self.manual_backward(loss)
        opt.step()
        opt_other.step()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        parts = self.parts()
        trained = [*parts.enc.parameters(), *parts.quant.parameters(), *parts.head.parameters()]
        return torch.optim.SGD(trained, lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, made_data())


class DPO(nn.Module):
    """x-transformers' DPO layout with ``parameters`` taking ``recurse``: the policy's only, not the reference's."""

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
        return sharded_loader(self, made_data())


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
    assert at_end.value.keys() == expected.keys()
    return max((at_end.value[key] - value).abs().max().item() for key, value in expected.items())


def run() -> dict[str, float | str]:
    return {case: difference_from_ddp(case) for case in CASES}


@pytest.fixture(scope="module")
def found() -> dict[str, float | str]:
    return on_ranks(run)[0]


@pytest.mark.parametrize("case", ["child", "joined"])
def test_a_weight_read_before_its_owner_runs_matches_ddp_at_zero3(found: dict[str, float | str], case: str) -> None:
    assert found[case] == 0.0, found[case]


def test_a_forward_pre_hook_reading_a_weight_matches_ddp(found: dict[str, float | str]) -> None:
    assert found["pre_hook_read"] == 0.0, found["pre_hook_read"]


def test_an_exception_in_a_forward_pre_hook_leaves_later_forwards_as_ddp(found: dict[str, float | str]) -> None:
    assert found["pre_hook_raises"] == 0.0, found["pre_hook_raises"]


def test_a_weights_dtype_and_hasattr_outside_forward_are_answered(found: dict[str, float | str]) -> None:
    assert found["metadata"] == 0.0, found["metadata"]


def test_a_parameters_override_that_leaves_the_reference_out_is_refused_at_setup(
    found: dict[str, float | str],
) -> None:
    message = found["dpo"]
    assert isinstance(message, str) and message.startswith("ValueError: The submodule 'dpo'"), message
    assert "does not return all of its parameters" in message and "ZeRO-0/1/2" in message, message
