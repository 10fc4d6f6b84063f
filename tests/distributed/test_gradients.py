"""``strategy.full_gradients(name)`` gives plain PyTorch's gradients between backward and step at every stage.

On 2 ranks, the ``shared`` pattern's first backward (one loss over both engines, so the discriminator's gradients
come from two uses), at one ZeRO stage and precision: each rank returns what ``full_gradients`` gives for each
engine after ``manual_backward``, what it gives in the module's ``on_after_backward`` hook and in a callback's (keys
prefixed ``hook.`` and ``callback.``), and its unknown-name error (the tests read rank 0's). With ``micro``, the
loss is backpropagated as ``micro`` backwards of ``loss / micro``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

TOLERANCES = {"32-true": 1e-6, "bf16-mixed": 2e-2}


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


def read_gradients(stage: int, precision: str, config: dict[str, Any] | None = None, micro: int = 1) -> dict[str, Any]:
    """On each rank: fit ``Reader`` at ``stage`` and ``precision`` (DeepSpeed ``config``); what it read."""
    module = Reader(micro)
    trainer = cpu_trainer(
        MultiDeepSpeedStrategy(stage=stage, config=config),
        precision=precision,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=[CallbackReader(module.read)],
    )
    trainer.fit(module)
    return module.read


def pytorch_gradients() -> dict[str, torch.Tensor]:
    G, D = patterns.make_modules()
    real, z = patterns.split(patterns.make_batches(2)[:8])
    ((D(G(z)) - 0.3).pow(2).mean() + D(real).pow(2).mean()).backward()
    grads = {f"generator.{n}": p.grad for n, p in G.named_parameters()}
    return grads | {f"discriminator.{n}": p.grad for n, p in D.named_parameters()}


def assert_read_as_pytorch(read: dict, precision: str) -> None:
    expected = pytorch_gradients()
    for where in ("", "hook.", "callback."):  # after manual_backward, in on_after_backward of module and callback
        for key, grad in expected.items():
            assert read[where + key].shape == grad.shape, where + key
            diff = (read[where + key] - grad).abs().max().item()
            assert diff <= TOLERANCES[precision] * max(1.0, grad.abs().max().item()), f"{where}{key}: {diff:.2e}"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_gradients_match_pytorch(stage: int, precision: str) -> None:
    read = on_ranks(read_gradients, stage, precision, timeout=300)[0]
    assert_read_as_pytorch(read, precision)
    assert "no trainable engine 'critic'" in read["error"]
    for key, grad in pytorch_gradients().items():  # read before any backward reached the engines
        assert torch.equal(read[f"before.{key}"], torch.zeros_like(grad)), key


def test_full_gradients_refuses_zero2_with_an_fp32_accumulator() -> None:
    """DeepSpeed keeps those reduced gradients where no fragment can be read before ``step()``: a clear error."""
    config = {"data_types": {"grad_accum_dtype": "fp32"}}
    refused = on_ranks(read_gradients, 2, "bf16-mixed", config, timeout=300)[0]["refused"]
    assert (
        "engine 'discriminator' with `data_types.grad_accum_dtype` set" in refused and "Remove the setting" in refused
    )


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("stage", [1, 3])
def test_full_gradients_with_an_offloaded_optimizer(stage: int, backwards: int) -> None:
    """``offload_optimizer``: DeepSpeed's host fp32 partition holds a step's gradient only once ``step()`` runs."""
    assert_read_as_pytorch(on_ranks(read_gradients, stage, "32-true", OFFLOAD, backwards, timeout=300)[0], "32-true")


@pytest.mark.parametrize("stage", [0, 1])
def test_full_gradients_accumulated_under_deepspeeds_bf16_optimizer(stage: int) -> None:
    """Two backwards of ``loss / 2``: ``BF16_Optimizer`` keeps their sum in fp32 beside ``param.grad`` (the last).

    DeepSpeed picks that optimizer for bf16 at stage 0, and at stage 1 with an fp32 gradient accumulator.
    """
    config = {"data_types": {"grad_accum_dtype": "fp32"}} if stage == 1 else {}
    read = on_ranks(read_gradients, stage, "bf16-mixed", config, 2, timeout=300)[0]
    assert_read_as_pytorch(read, "bf16-mixed")
    for key, grad in pytorch_gradients().items():  # bf16 rounds each element; the norm must agree closely
        assert read[key].norm().item() == pytest.approx(grad.norm().item(), rel=0.05), key
