"""``Trainer(gradient_clip_val=...)`` in automatic optimization goes through ``configure_gradient_clipping``; torch's
own clipping over an engine's parameters is refused at the call.

On 2 ranks, :func:`fit_each_mode` trains one engine (the generator) on a regression for 4 steps with SGD, clipped
to ``CLIP``: by Lightning's own ``configure_gradient_clipping`` (``default``), or by an override that clips on even
steps only (``even_steps``). Each rank returns the weights per mode; the test reads rank 0's.
:func:`clip_with_torch` runs manual-optimization fits that call ``torch.nn.utils``' clipping between backward and
step; each rank returns what each fit ended with.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm  # imported before any fit, as user modules do
from torch import nn
from torch.nn.utils import clip_grad_norm_  # imported before any fit, as user modules do

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks
from tests.distributed.test_patterns import TOLERANCE, assert_matches

CLIP = 0.1
STEPS = 4
MODES = ("default", "even_steps")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator, _ = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return patterns.regression_loss(self.generator, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("sgd", self.generator.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))


class ClipsEvenSteps(Regression):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.trainer.global_step % 2 == 0:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="norm")


def fit_each_mode(stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: fit once per mode at ZeRO-``stage``; the consolidated weights per mode."""
    results = {}
    for mode in MODES:
        module = Regression() if mode == "default" else ClipsEvenSteps()
        trainer = cpu_trainer(
            MultiDeepSpeedStrategy(stage=stage),
            gradient_clip_val=CLIP,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        state = trainer.strategy.consolidated_state_dict()
        results[mode] = {k: v.float().clone() for k, v in state.items()}
    return results


def reference(mode: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch: clip to ``CLIP`` before every step (``default``) or before even steps only."""
    G, _ = patterns.make_modules()
    optimizer = patterns.make_optimizer("sgd", G.parameters())
    data = patterns.make_batches(STEPS)
    for step in range(STEPS):
        patterns.regression_loss(G, data[step * 8 : (step + 1) * 8]).backward()
        if mode == "default" or step % 2 == 0:
            torch.nn.utils.clip_grad_norm_(G.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {f"generator.{k}": v.detach().clone() for k, v in G.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_overridden_configure_gradient_clipping_is_honoured(stage: int) -> None:
    results = on_ranks(fit_each_mode, stage, timeout=300)[0]
    assert (reference("default")["generator.2.bias"] - reference("even_steps")["generator.2.bias"]).abs().max() > 1e-3
    for mode in MODES:
        assert_matches(results[mode], reference(mode), TOLERANCE)


class ClipsWithTorch(pl.LightningModule):
    """Manual optimization that clips with torch between backward and step, as a DDP user writes it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.how = how
        self.generator, _ = patterns.make_modules()
        self.unused = nn.Linear(2, 2)  # a plain submodule: no engine's, and no gradient

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(patterns.regression_loss(self.generator, batch))
        params = self.unused.parameters() if self.how == "plain" else self.generator.parameters()
        if self.how == "value":
            torch.nn.utils.clip_grad_value_(params, CLIP)
        elif self.how == "with_norm":  # torch's two halves of clip_grad_norm_, the norm read the supported way
            total = torch.nn.utils.get_total_norm(list(self.trainer.strategy.full_gradients("generator").values()))
            torch.nn.utils.clip_grads_with_norm_(params, CLIP, total)
        elif self.how == "imported":
            clip_grad_norm_(params, CLIP)
        elif self.how == "read":  # a norm logged from `param.grad`
            self.log("norm", torch.stack([p.grad.norm() for p in self.generator.parameters()]).norm())
        elif self.how in ("norm", "plain"):
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        if self.how == "after":  # after the step `param.grad` is no one's business but the reader's
            assert all(p.grad is None for p in self.generator.parameters())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.how == "grad_norm":  # Lightning's documented way to log gradient norms
            self.log_dict(grad_norm(self.generator, norm_type=2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("sgd", self.generator.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))


def clip_with_torch(cases: list[str]) -> dict[str, str]:
    """On each rank: one fit per case ``HOW:STAGE``; ``ok``, or the error it ended with; torch's functions after."""
    results, modules = {}, []
    for case in cases:
        how, stage = case.split(":")
        trainer = cpu_trainer(MultiDeepSpeedStrategy(stage=int(stage)), enable_checkpointing=False)
        modules.append(ClipsWithTorch(how))
        try:
            trainer.fit(modules[-1])
            results[case] = "ok"
        except (ValueError, RuntimeError) as error:
            results[case] = str(error)
    clip_grad = torch.nn.utils.clip_grad
    results["restored"] = str(
        all(type(p) is nn.Parameter for module in modules for p in module.parameters())
        and clip_grad.clip_grad_value_ is torch.nn.utils.clip_grad_value_ is ORIGINAL_VALUE
        and clip_grad._clip_grads_with_norm_ is ORIGINAL_NORM
        and torch.nn.utils.clip_grads_with_norm_ is ORIGINAL_WITH_NORM
    )
    return results


ORIGINAL_VALUE = torch.nn.utils.clip_grad_value_
ORIGINAL_NORM = torch.nn.utils.clip_grad._clip_grads_with_norm_
ORIGINAL_WITH_NORM = torch.nn.utils.clip_grads_with_norm_


def test_torch_clipping_and_gradient_reads_over_an_engine_are_refused_at_the_call() -> None:
    """Under DDP ``param.grad`` is averaged by then; here it is each rank's own (ZeRO-0/1) or None (ZeRO-2/3).

    A read from user code between backward and step is refused (``read``, and Lightning's ``grad_norm`` in
    ``on_before_optimizer_step``); after the step it passes; torch's clipping reads it itself and is refused at the
    clipping. Teardown gives the parameters their class back and torch its functions.
    """
    cases = ["norm:0", "norm:2", "norm:3", "imported:1", "value:2", "with_norm:0", "plain:2"]
    cases += ["read:0", "read:3", "grad_norm:1", "after:2"]
    for rank, results in enumerate(on_ranks(clip_with_torch, cases, timeout=300)):
        assert results.pop("plain:2") == "ok", f"rank {rank}: a plain submodule's clipping is torch's own"
        assert results.pop("after:2") == "ok", f"rank {rank}: a read after the step passes"
        assert results.pop("restored") == "True", f"rank {rank}: teardown puts classes and torch's functions back"
        for case in ("read:0", "read:3", "grad_norm:1"):
            message, stage = results.pop(case), case[-1]
            read = f"`param.grad` of a parameter of engine 'generator' (ZeRO-{stage}) was read between the backward"
            assert message.startswith(read), f"rank {rank}, {case}: {message}"
            held = "None" if int(stage) >= 2 else "this rank's own gradient"
            assert held in message and "full_gradients('generator')" in message, message
            reader = "lightning.pytorch.utilities.grads" if case.startswith("grad_norm") else __name__
            assert f"(in {reader})" in message, message
        for case, message in results.items():
            how, stage = case.split(":")
            function = {"value": "clip_grad_value_", "with_norm": "clip_grads_with_norm_"}.get(how, "clip_grad_norm_")
            expected = f"`torch.nn.utils.{function}` over the parameters of engine 'generator' (ZeRO-{stage})"
            assert message.startswith(expected), f"rank {rank}, {case}: {message}"
            held = "None" if int(stage) >= 2 else "this rank's own gradient"
            assert held in message and "self.clip_gradients(opt, gradient_clip_val=...)" in message, message
            assert "full_gradients('generator')" in message, message
