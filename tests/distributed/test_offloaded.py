"""``strategy.offloaded(name)``: an engine's states off the device for a block, then training on exactly.

On 2 ranks, :func:`fit_each_spec` fits a GAN (Adam) once per SPEC ``G_STAGE:D_STAGE``. Each step offloads the
discriminator's states while the generator samples, then trains the GAN. The first step also calls the
discriminator and steps it inside the block, offloads the generator alone, nests, and names a frozen and an
unknown engine. Each rank returns {spec: {"weights", "states", "errors"}}; the tests read rank 0's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

STEPS = 3
SPECS = ["1:1", "2:2", "0:2", "3:1"]


class OffloadedGAN(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps = steps
        self.generator, self.discriminator = patterns.make_modules()
        self.critic = copy.deepcopy(self.discriminator)  # frozen
        self.seen: dict[str, Any] = {"states": [], "errors": {}}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, z = patterns.split(batch)
        opt_g, opt_d = self.optimizers()
        strategy = self.trainer.strategy
        with strategy.offloaded("discriminator"):
            self.seen["states"].append(sorted(str(s.value) for s in opt_d.engine.optimizer.offloaded_states))
            with torch.no_grad():
                self.generator(z)
            if batch_idx == 0:
                self.attempt("forward", lambda: self.discriminator(z))
                self.attempt("step", opt_d.step)
                self.attempt("nested", lambda: offload(strategy, "discriminator"))
        self.seen["states"].append(sorted(str(s.value) for s in opt_d.engine.optimizer.offloaded_states))
        if batch_idx == 0:
            for name in ("generator", "critic", "actor"):  # trainable at the spec's stage, frozen, unknown
                self.attempt(name, lambda name=name: offload(strategy, name))
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def attempt(self, what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except (ValueError, RuntimeError) as error:
            self.seen["errors"][what] = str(error)
        else:
            self.seen["errors"][what] = "no error"

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(self.steps))


def offload(strategy: MultiDeepSpeedStrategy, name: str) -> None:
    with strategy.offloaded(name):
        pass


def fit_each_spec(steps: int, specs: list[str]) -> dict[str, dict[str, Any]]:
    """On each rank: fit once per spec; the consolidated weights and what the module saw."""
    results = {}
    for spec in specs:
        g_stage, d_stage = map(int, spec.split(":"))
        module = OffloadedGAN(steps)
        strategy = MultiDeepSpeedStrategy(
            engine_configs={
                "generator": {"zero_optimization": {"stage": g_stage}},
                "discriminator": {"zero_optimization": {"stage": d_stage}},
                "critic": {"zero_optimization": {"stage": 0}},
            }
        )
        trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
        trainer.fit(module)
        weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
        results[spec] = {"weights": weights, **module.seen}
    return results


@pytest.fixture(scope="module")
def results() -> dict:
    return on_ranks(fit_each_spec, STEPS, SPECS, timeout=300)[0]


@pytest.mark.parametrize("spec", SPECS)
def test_states_move_out_and_back_and_training_matches_pytorch(results: dict, spec: str) -> None:
    """Discriminator at ZeRO-1/2, offloaded around sampling every step: Adam weights equal plain PyTorch's."""
    result = results[spec]
    offloaded = result["states"][0::2]
    assert all(set(states) >= {"hp_params", "lp_params", "optim_states"} for states in offloaded), offloaded
    assert result["states"][1::2] == [[]] * STEPS, "every state is back after the block"
    G, D = patterns.make_modules()
    opt_g, opt_d = patterns.make_optimizer("adam", G.parameters()), patterns.make_optimizer("adam", D.parameters())
    data = patterns.make_batches(STEPS)
    for step in range(STEPS):
        patterns.gan_zero_first(G, D, data[step * 8 : (step + 1) * 8], opt_g, opt_d, lambda loss: loss.backward())
    for key, value in patterns.weights(G, D).items():
        diff = (result["weights"][key] - value).abs().max().item()
        assert diff <= 1e-5, f"{spec} {key}: max abs difference {diff:.2e} from plain PyTorch"


def test_inside_the_block_the_engine_neither_runs_nor_steps(results: dict) -> None:
    errors = results["2:2"]["errors"]
    assert "`self.discriminator` was called inside `strategy.offloaded('discriminator')`" in errors["forward"]
    assert "`opt.step()` of engine 'discriminator' inside `strategy.offloaded('discriminator')`" in errors["step"]
    assert "the engine is inside `strategy.offloaded('discriminator')` already; don't nest them" in errors["nested"]


def test_engines_deepspeed_cannot_offload_are_refused_by_name(results: dict) -> None:
    assert results["1:1"]["errors"]["generator"] == "no error"
    assert (
        "`offloaded('generator')`: DeepSpeed cannot move the engine's states: it is at ZeRO-0"
        in (results["0:2"]["errors"]["generator"])
    )
    zero3 = results["3:1"]["errors"]["generator"]
    assert "it is at ZeRO-3, where DeepSpeed moves optimizer states only of its own FusedAdam" in zero3
    frozen = results["2:2"]["errors"]["critic"]
    assert "no trainable engine 'critic' (a frozen engine has no optimizer states" in frozen
    assert (
        "no trainable engine 'actor'. Trainable engines exist during fit: ['discriminator', 'generator']"
        in (results["2:2"]["errors"]["actor"])
    )
