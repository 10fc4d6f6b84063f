"""``strategy.gathered(name)``: a ZeRO-3 submodule whole for a block, then partitioned and training as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import patterns
from tests.distributed import run_gathered
from tests.distributed.harness import run_ranks

STEPS = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("gathered") / "results.pt"
    run_ranks(Path(run_gathered.__file__), str(out), str(STEPS), timeout=300)
    return [torch.load(f"{out}.{rank}") for rank in (0, 1)]


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


def test_misuse_is_refused_and_an_exception_leaves_it_usable(results: list[dict]) -> None:
    for seen in results:
        raised, nested, unknown, stepped = seen["errors"]
        assert raised == "raised inside the block"
        assert "`gathered('generator')`: the engine is inside `strategy.gathered('generator')` already" in nested
        assert "there is no engine 'critic' now (engines: ['discriminator', 'generator', 'teacher'])" in unknown
        assert "`opt.step()` of engine 'generator' inside `strategy.gathered('generator')`" in stepped
