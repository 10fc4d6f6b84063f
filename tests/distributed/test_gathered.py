"""``strategy.gathered(name)``: a ZeRO-3 submodule whole for a block, then partitioned and training as before.

On 2 ranks, :func:`fit` trains a ZeRO-3 GAN with a frozen ZeRO-3 copy beside it. Each step samples the generator
and the frozen copy inside ``gathered`` and outside it (ZeRO-3's per-layer gathering), runs the discriminator
(whose small parameters ZeRO-3 keeps whole: its default persistence threshold) inside ``gathered``, then trains
the GAN. The first step also raises inside a block, nests one, names an unknown engine and steps inside a block.
Each rank returns its weights after fit and what each block saw.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._blocks import BlockError
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

STEPS = 3
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def whole(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` holds its whole data on this rank now."""
    return all(p.numel() == p.ds_numel for p in module.parameters())


class GatheredGAN(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps = steps
        self.generator, self.discriminator = patterns.make_modules()
        self.teacher = copy.deepcopy(self.generator)
        self.seen: dict[str, Any] = {"max_diff": 0.0, "whole_inside": [], "whole_after": [], "errors": []}
        # whole_after: whether the submodule was whole after the block, or after a forward following it

    def sample(self, name: str, z: torch.Tensor) -> None:
        module = getattr(self, name)
        with torch.no_grad():
            layered = module(z)
        with self.trainer.strategy.gathered(name) as gathered:
            assert gathered is module
            inside = whole(module)
            out = gathered(z)
            self.seen["whole_inside"].append(inside and whole(module) and not torch.is_grad_enabled())
        after_block = whole(module)
        with torch.no_grad():
            module(z)  # ZeRO-3's hooks are back: the forward gathers each layer and releases it after
        self.seen["whole_after"].append(after_block or whole(module))
        self.seen["max_diff"] = max(self.seen["max_diff"], (out - layered).abs().max().item())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, z = patterns.split(batch)
        if batch_idx == 0:
            self.misuse(z)
        self.sample("generator", z)
        self.sample("teacher", z)
        with self.trainer.strategy.gathered("teacher", modifier_rank=0) as teacher:  # a frozen ZeRO-3 engine
            for param in teacher.parameters():  # rank 0's (unchanged) weights are kept, rank 1's halved ones dropped
                param.mul_(1.0 if self.global_rank == 0 else 0.5)
        with self.trainer.strategy.gathered("discriminator") as discriminator:  # persistent parameters: whole always
            discriminator(patterns.split(batch)[0])
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def misuse(self, z: torch.Tensor) -> None:
        strategy = self.trainer.strategy
        try:
            with strategy.gathered("generator") as generator:
                generator(z)
                raise RuntimeError("raised inside the block")
        except RuntimeError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("generator"), strategy.gathered("generator"):
                pass
        except BlockError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("critic"):
                pass
        except ValueError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("generator"):
                self.optimizers()[0].step()
        except RuntimeError as error:
            self.seen["errors"].append(str(error))
        try:
            with strategy.gathered("generator", modifier_rank=2):
                pass
        except ValueError as error:
            self.seen["errors"].append(str(error))
        try:
            self.generator.load_state_dict(patterns.make_modules()[0].state_dict())
        except RuntimeError as error:
            self.seen["errors"].append(str(error))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(self.steps))


def fit(steps: int) -> dict[str, Any]:
    """On each rank: fit; the consolidated weights and what each block saw."""
    module = GatheredGAN(steps)
    strategy = MultiDeepSpeedStrategy(
        engine_configs={"generator": ZERO3, "discriminator": {"zero_optimization": {"stage": 3}}, "teacher": ZERO3},
    )
    trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(module)
    weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
    return {"weights": weights, **module.seen}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return on_ranks(fit, STEPS, timeout=300)


def test_inside_the_block_the_submodule_is_whole_and_gives_the_same_outputs(results: list[dict]) -> None:
    """Whole on entry and still whole after a forward (ZeRO-3's release hooks are off), no_grad, same samples."""
    for seen in results:
        assert seen["whole_inside"] == [True] * (2 * STEPS), "a trained and a frozen ZeRO-3 engine, every step"
        assert seen["whole_after"] == [False] * (2 * STEPS), "partitioned after the block and after the next forward"
        assert seen["max_diff"] <= 1e-6


def test_training_after_the_blocks_matches_plain_pytorch(results: list[dict]) -> None:
    """The hooks come back: ZeRO-3 training after each block (and after one that raised) equals plain PyTorch."""
    G, D = patterns.make_modules()
    opt_g, opt_d = patterns.make_optimizer("adam", G.parameters()), patterns.make_optimizer("adam", D.parameters())
    data = patterns.make_batches(STEPS)
    for step in range(STEPS):
        patterns.gan_zero_first(G, D, data[step * 8 : (step + 1) * 8], opt_g, opt_d, lambda loss: loss.backward())
    expected = patterns.weights(G, D)
    for seen in results:
        for key, value in expected.items():
            diff = (seen["weights"][key] - value).abs().max().item()
            assert diff <= 1e-5, f"{key}: max abs difference {diff:.2e} from plain PyTorch"


def test_an_edit_of_a_frozen_zero3_engine_keeps_the_modifier_ranks_weights(results: list[dict]) -> None:
    """Rank 1 halves the teacher's weights inside ``gathered("teacher", modifier_rank=0)`` each step; rank 0 keeps
    them: every rank ends with rank 0's, the weights the teacher started with."""
    initial = {f"teacher.{k}": v for k, v in patterns.make_modules()[0].state_dict().items()}
    for seen in results:
        for key, value in initial.items():
            assert torch.equal(seen["weights"][key], value), key


def test_misuse_is_refused_and_an_exception_leaves_it_usable(results: list[dict]) -> None:
    for seen in results:
        raised, nested, unknown, stepped, no_rank, loaded = seen["errors"]
        assert raised == "raised inside the block"
        assert "`gathered('generator')`: the engine is inside `strategy.gathered('generator')` already" in nested
        assert "there is no engine 'critic' now (engines: ['discriminator', 'generator', 'teacher'])" in unknown
        assert "`opt.step()` of engine 'generator' inside `strategy.gathered('generator')`" in stepped
        assert "`gathered('generator', modifier_rank=2)`: the modifier rank is the global rank" in no_rank
        assert "one of 0 to 1; pass one of those" in no_rank
        assert "`load_state_dict` into the ZeRO-3 engine 'generator' outside `strategy.gathered('generator', " in loaded
