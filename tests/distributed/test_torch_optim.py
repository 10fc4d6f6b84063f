"""An optimizer's step over an engine's parameters as ``torch.optim`` takes it, against plain PyTorch.

A 0-dim parameter (a learned temperature, CLIP's ``logit_scale``, SAC's ``log_alpha``) trains at every stage, in a
submodule built in ``__init__`` or in ``configure_model`` (under ``zero.Init`` at ZeRO-3), and a fit saved after its
first epoch resumes to the same weights; the export keeps its shape and loads with ``load_state_dict``.

Optimizers: at ZeRO-1/2/3 DeepSpeed steps the optimizer over flat partitions, so only element-wise ones train
there; a tensor-wise one (Adafactor) trains at ZeRO-0 as in plain PyTorch, and an optimizer the user declares
element-wise (``elementwise_optimizers``), or a subclass of a known one keeping its ``step``, trains at ZeRO-2.
(The refusal of an undeclared one is in ``test_errors``.)
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.checkpoint import consolidated_state_dicts
from tests.distributed.common import AtFitEnd, cpu_trainer, global_batch, regression_data, sharded_loader
from tests.distributed.harness import on_ranks

STEPS, PER_RANK, EPOCHS = 2, 4, 2


class Tempered(nn.Module):
    """A 4-8-1 MLP whose output is scaled by ``exp(log_scale)``, a 0-dim parameter (CLIP's learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.log_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(1) * self.log_scale.exp()


def tempered_loss(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(batch[:, :4]), batch[:, 4])


class LoggingAdam(torch.optim.Adam):
    """A subclass of a known element-wise optimizer that keeps its ``step``."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.created = True


class SignSGD(torch.optim.Optimizer):
    """An element-wise optimizer the strategy does not know: ``p -= lr * sign(grad)``."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.05),
    "logging_adam": lambda params: LoggingAdam(params, lr=0.05),
    "sign_sgd": lambda params: SignSGD(params, lr=0.01),
}


class WithTemperature(pl.LightningModule):
    def __init__(self, late: bool = False, optimizer: str = "adam") -> None:
        super().__init__()
        self.late, self.optimizer = late, optimizer
        if not late:
            self.net = Tempered()
        self.automatic_optimization = False

    def configure_model(self) -> None:
        if self.late and not hasattr(self, "net"):
            self.net = Tempered()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(tempered_loss(self.net, batch))
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer](self.net.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


def fit_with_temperature(folder: str, stage: int, late: bool) -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: the weights after :data:`EPOCHS` epochs in one fit and in two (saved after the first, resumed),
    and the export of the first's checkpoint loaded into a new module."""
    results = {}
    for name, epochs, ckpt in [("whole", EPOCHS, None), ("first", 1, None), ("resumed", EPOCHS, "first")]:
        at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
        trainer = cpu_trainer(
            MultiDeepSpeedStrategy(stage=stage),
            callbacks=[at_end],
            max_epochs=epochs,
            use_distributed_sampler=False,
            enable_checkpointing=False,
        )
        trainer.fit(WithTemperature(late), ckpt_path=f"{folder}/{ckpt}.ckpt" if ckpt else None)
        trainer.save_checkpoint(f"{folder}/{name}.ckpt")
        results[name] = {key: value.clone() for key, value in at_end.value.items()}
    exported = Tempered()
    exported.load_state_dict(consolidated_state_dicts(f"{folder}/first.ckpt")["net"])
    results["exported"] = {f"net.{key}": value for key, value in exported.state_dict().items()}
    return results


def fit_optimizers(cases: list[tuple[str, int]]) -> list[dict[str, torch.Tensor]]:
    """On each rank: the weights after a fit with each ``(optimizer, stage)``, ``SignSGD`` declared element-wise."""
    results = []
    for optimizer, stage in cases:
        at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
        strategy = MultiDeepSpeedStrategy(stage=stage, elementwise_optimizers=[f"{__name__}.SignSGD"])
        trainer = cpu_trainer(strategy, callbacks=[at_end], use_distributed_sampler=False, enable_checkpointing=False)
        trainer.fit(WithTemperature(optimizer=optimizer))
        results.append(at_end.value)
    return results


def reference(epochs: int, optimizer: str = "adam") -> dict[str, torch.Tensor]:
    net = Tempered()
    optimizer = OPTIMIZERS[optimizer](net.parameters())
    data = regression_data(STEPS, PER_RANK)
    for _ in range(epochs):
        for step in range(STEPS):
            optimizer.zero_grad()
            tempered_loss(net, global_batch(data, step, PER_RANK)).backward()
            optimizer.step()
    return {f"net.{key}": value for key, value in net.state_dict().items()}


@pytest.mark.parametrize(("stage", "late"), [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_a_0_dim_parameter_trains_saves_resumes_and_exports_with_its_shape(
    tmp_path: Path, stage: int, late: bool
) -> None:
    results = on_ranks(fit_with_temperature, str(tmp_path), stage, late)[0]
    expected = {"whole": reference(EPOCHS), "resumed": reference(EPOCHS), "first": reference(1)}
    expected["exported"] = expected["first"]
    for name, weights in expected.items():
        assert results[name].keys() == weights.keys(), name
        for key, value in weights.items():
            assert results[name][key].shape == value.shape, (name, key)
            torch.testing.assert_close(results[name][key], value, msg=f"{name}: {key}")


OPTIMIZER_CASES = [("adafactor", 0), ("logging_adam", 2), ("sign_sgd", 2), ("sign_sgd", 3)]


def test_tensor_wise_optimizers_train_at_zero0_and_declared_element_wise_ones_at_zero2_and_3() -> None:
    results = on_ranks(fit_optimizers, OPTIMIZER_CASES)[0]
    for (optimizer, stage), weights in zip(OPTIMIZER_CASES, results, strict=True):
        for key, value in reference(1, optimizer).items():
            torch.testing.assert_close(weights[key], value, msg=f"{optimizer} at ZeRO-{stage}: {key}")
