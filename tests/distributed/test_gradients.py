"""``strategy.full_gradients(name)`` gives plain PyTorch's gradients between backward and step at every stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import patterns
from tests.distributed.harness import run_ranks

RUNNER = Path(__file__).with_name("run_gradients.py")
TOLERANCES = {"32-true": 1e-6, "bf16-mixed": 2e-2}


def pytorch_gradients() -> dict[str, torch.Tensor]:
    G, D = patterns.make_modules()
    real, z = patterns.split(patterns.make_batches(2)[:8])
    ((D(G(z)) - 0.3).pow(2).mean() + D(real).pow(2).mean()).backward()
    grads = {f"generator.{n}": p.grad for n, p in G.named_parameters()}
    return grads | {f"discriminator.{n}": p.grad for n, p in D.named_parameters()}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_gradients_match_pytorch(tmp_path: Path, stage: int, precision: str) -> None:
    out = tmp_path / "grads.pt"
    run_ranks(RUNNER, str(out), str(stage), precision, timeout=300)
    read = torch.load(out)
    expected = pytorch_gradients()
    for key, grad in expected.items():
        assert read[key].shape == grad.shape, key
        diff = (read[key] - grad).abs().max().item()
        assert diff <= TOLERANCES[precision] * max(1.0, grad.abs().max().item()), f"{key}: {diff:.2e}"
    assert "no trainable engine 'critic'" in read["error"]


def test_full_gradients_refuses_zero2_with_an_fp32_accumulator(tmp_path: Path) -> None:
    """DeepSpeed keeps those reduced gradients where no fragment can be read before ``step()``: a clear error."""
    out = tmp_path / "grads.pt"
    config = json.dumps({"data_types": {"grad_accum_dtype": "fp32"}})
    run_ranks(RUNNER, str(out), "2", "bf16-mixed", config, timeout=300)
    refused = torch.load(out)["refused"]
    assert (
        "engine 'discriminator' with `data_types.grad_accum_dtype` set" in refused and "Remove the setting" in refused
    )
