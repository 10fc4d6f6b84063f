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


def assert_read_as_pytorch(read: dict, precision: str) -> None:
    expected = pytorch_gradients()
    for where in ("", "hook.", "callback."):  # after manual_backward, in on_after_backward of module and callback
        for key, grad in expected.items():
            assert read[where + key].shape == grad.shape, where + key
            diff = (read[where + key] - grad).abs().max().item()
            assert diff <= TOLERANCES[precision] * max(1.0, grad.abs().max().item()), f"{where}{key}: {diff:.2e}"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_gradients_match_pytorch(tmp_path: Path, stage: int, precision: str) -> None:
    out = tmp_path / "grads.pt"
    run_ranks(RUNNER, str(out), str(stage), precision, timeout=300)
    read = torch.load(out)
    assert_read_as_pytorch(read, precision)
    assert "no trainable engine 'critic'" in read["error"]
    for key, grad in pytorch_gradients().items():  # read before any backward reached the engines
        assert torch.equal(read[f"before.{key}"], torch.zeros_like(grad)), key


def test_full_gradients_refuses_zero2_with_an_fp32_accumulator(tmp_path: Path) -> None:
    """DeepSpeed keeps those reduced gradients where no fragment can be read before ``step()``: a clear error."""
    out = tmp_path / "grads.pt"
    config = json.dumps({"data_types": {"grad_accum_dtype": "fp32"}})
    run_ranks(RUNNER, str(out), "2", "bf16-mixed", config, timeout=300)
    refused = torch.load(out)["refused"]
    assert (
        "engine 'discriminator' with `data_types.grad_accum_dtype` set" in refused and "Remove the setting" in refused
    )


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("stage", [1, 3])
def test_full_gradients_with_an_offloaded_optimizer(tmp_path: Path, stage: int, backwards: int) -> None:
    """``offload_optimizer``: DeepSpeed's host fp32 partition holds a step's gradient only once ``step()`` runs."""
    out = tmp_path / "grads.pt"
    run_ranks(RUNNER, str(out), str(stage), "32-true", json.dumps(OFFLOAD), str(backwards), timeout=300)
    assert_read_as_pytorch(torch.load(out), "32-true")


@pytest.mark.parametrize("stage", [0, 1])
def test_full_gradients_accumulated_under_deepspeeds_bf16_optimizer(tmp_path: Path, stage: int) -> None:
    """Two backwards of ``loss / 2``: ``BF16_Optimizer`` keeps their sum in fp32 beside ``param.grad`` (the last).

    DeepSpeed picks that optimizer for bf16 at stage 0, and at stage 1 with an fp32 gradient accumulator.
    """
    out = tmp_path / "grads.pt"
    config = json.dumps({"data_types": {"grad_accum_dtype": "fp32"}} if stage == 1 else {})
    run_ranks(RUNNER, str(out), str(stage), "bf16-mixed", config, "2", timeout=300)
    read = torch.load(out)
    assert_read_as_pytorch(read, "bf16-mixed")
    for key, grad in pytorch_gradients().items():  # bf16 rounds each element; the norm must agree closely
        assert read[key].norm().item() == pytest.approx(grad.norm().item(), rel=0.05), key
