"""``strategy.offloaded(name)``: an engine's states off the device for a block, then training on exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import patterns
from tests.distributed import run_offloaded
from tests.distributed.harness import run_ranks

STEPS = 3
SPECS = ["1:1", "2:2", "0:2", "3:1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("offloaded") / "results.pt"
    run_ranks(Path(run_offloaded.__file__), str(out), str(STEPS), *SPECS, timeout=300)
    return torch.load(out)


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
