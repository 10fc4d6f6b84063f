"""DeepSpeed is given Lightning's device: with `Trainer(devices=[1])` or `[2, 3]` engines go where the module is.

No GPU is needed: the strategy's root device comes from its device list and cluster environment (stand-ins for
what the Trainer passes), and ``deepspeed.initialize`` is replaced by a recorder of what it is given.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids import _lifecycle as lifecycle


def root_device(devices: list[int], local_rank: int, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The strategy's device on the process of ``local_rank`` of a Trainer given ``devices=devices``."""
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    strategy = MultiDeepSpeedStrategy(
        parallel_devices=[torch.device("cuda", index) for index in devices], cluster_environment=LightningEnvironment()
    )
    return strategy.root_device


def received(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``deepspeed.initialize`` receives for an engine built on ``device``."""
    calls: list[dict[str, Any]] = []

    def initialize(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(lifecycle.deepspeed, "initialize", initialize)
    with pytest.raises(RuntimeError, match="recorded"):
        lifecycle.build_engine(torch.nn.Linear(2, 2), {}, device=device)
    return calls[0]


@pytest.mark.parametrize(("devices", "local_rank", "index"), [([1], 0, 1), ([2, 3], 0, 2), ([2, 3], 1, 3)])
def test_deepspeed_gets_lightnings_device_index(
    devices: list[int], local_rank: int, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = root_device(devices, local_rank, monkeypatch)
    assert device == torch.device("cuda", index)
    assert received(device, monkeypatch)["args"].device_rank == index  # not LOCAL_RANK, DeepSpeed's own choice


def test_a_cpu_engine_gets_no_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    assert received(torch.device("cpu"), monkeypatch)["args"] is None  # DeepSpeed's CPU accelerator has none


def test_zero3_on_a_device_other_than_the_local_ranks_is_refused_naming_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    lifecycle.check_zero3_device(["teacher"], torch.device("cuda", 1))  # devices=2 (or [0, 1]): as DeepSpeed expects
    lifecycle.check_zero3_device(["teacher"], torch.device("cpu"))
    lifecycle.check_zero3_device([], torch.device("cuda", 3))  # no ZeRO-3 engine: every stage below runs there
    with pytest.raises(ValueError, match=r"\['teacher'\] would run partly on GPU 1.*cuda:3.*CUDA_VISIBLE_DEVICES=2,3"):
        lifecycle.check_zero3_device(["teacher"], torch.device("cuda", 3))
    assert not lifecycle.zero3_on_device(torch.device("cuda", 3))  # configure_model then builds without zero.Init
