"""Layers shared between submodules: what trains as plain PyTorch, and what is refused at setup (2 ranks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    outputs = run_ranks(Path(__file__).with_name("run_sharing.py"), timeout=300)
    return [dict(re.findall(r"^RESULT (\w+): (.*)$", out, flags=re.M)) for out in outputs]


@pytest.mark.parametrize("stages", ["2_2", "0_1"])
def test_two_trained_heads_on_one_frozen_layer_train_as_plain_pytorch(results: list[dict], stages: str) -> None:
    for rank, messages in enumerate(results):
        said = messages[f"frozen_encoder_zero{stages}"]
        found = re.fullmatch(r"trained, (\S+) from plain PyTorch", said)
        assert found and float(found.group(1)) <= 1e-6, f"rank {rank}: {said}"


def test_a_frozen_layer_shared_with_a_zero3_engine_is_refused(results: list[dict]) -> None:
    for messages in results:
        assert re.search(r"engines 'a' and 'b' share a parameter", messages["frozen_encoder_zero3_0"])


def test_a_layer_tied_in_configure_model_to_a_zero3_engine_is_refused(results: list[dict]) -> None:
    for messages in results:
        assert re.search(
            r"submodule 'probe' shares a parameter with the ZeRO-3 submodule 'discriminator'.*copy that does not train",
            messages["tied_in_configure_model"],
        ), messages["tied_in_configure_model"]
