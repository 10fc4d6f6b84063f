"""``Trainer(gradient_clip_val=...)`` in automatic optimization goes through ``configure_gradient_clipping``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import patterns
from tests.distributed import run_clipping as case
from tests.distributed.harness import run_ranks
from tests.distributed.test_patterns import TOLERANCE, assert_matches


def reference(mode: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch: clip to ``CLIP`` before every step (``default``) or before even steps only."""
    G, _ = patterns.make_modules()
    optimizer = patterns.make_optimizer("sgd", G.parameters())
    data = patterns.make_batches(case.STEPS)
    for step in range(case.STEPS):
        patterns.regression_loss(G, data[step * 8 : (step + 1) * 8]).backward()
        if mode == "default" or step % 2 == 0:
            torch.nn.utils.clip_grad_norm_(G.parameters(), case.CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {f"generator.{k}": v.detach().clone() for k, v in G.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_overridden_configure_gradient_clipping_is_honoured(tmp_path: Path, stage: int) -> None:
    out = tmp_path / "weights.pt"
    run_ranks(Path(case.__file__), str(out), str(stage), timeout=300)
    results = torch.load(out)
    assert (reference("default")["generator.2.bias"] - reference("even_steps")["generator.2.bias"]).abs().max() > 1e-3
    for mode in case.MODES:
        assert_matches(results[mode], reference(mode), TOLERANCE)
