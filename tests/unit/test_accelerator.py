"""DeepSpeed's accelerator follows Lightning's, decided from what is visible, without a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

from lightning_multids import _accelerator as accelerator


@pytest.fixture
def deepspeed_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Leave DeepSpeed's accelerator and DS_ACCELERATOR as they were."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    before = get_accelerator()
    yield
    set_accelerator(before)


@pytest.mark.parametrize(("device_type", "env"), [("cpu", None), ("cuda", None), ("cpu", "cpu"), ("cuda", "cuda")])
def test_deepspeed_uses_the_device_lightning_chose(device_type: str, env: str | None) -> None:
    assert accelerator.choose(device_type, env) == device_type


@pytest.mark.parametrize(("device_type", "env"), [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_contradicting_ds_accelerator_is_refused(device_type: str, env: str) -> None:
    with pytest.raises(ValueError, match=rf"DS_ACCELERATOR={env}.*'{device_type}' devices.*Unset DS_ACCELERATOR"):
        accelerator.choose(device_type, env)


def test_devices_deepspeed_cannot_follow_are_refused() -> None:
    with pytest.raises(ValueError, match=r"CPU or CUDA.*gives 'mps' devices.*accelerator='cpu'"):
        accelerator.choose("mps", None)


@pytest.mark.usefixtures("deepspeed_accelerator")
def test_cpu_training_on_a_gpu_machine_switches_deepspeed_to_cpu() -> None:
    set_accelerator(CUDA_Accelerator())  # what DeepSpeed picks by itself whenever a GPU is visible
    accelerator.follow("cpu")
    assert get_accelerator().device_name() == "cpu"
    current = get_accelerator()
    accelerator.follow("cpu")
    assert get_accelerator() is current  # already right: left alone


@pytest.mark.usefixtures("deepspeed_accelerator")
def test_cuda_training_switches_deepspeed_to_cuda() -> None:
    accelerator.follow("cuda")
    assert get_accelerator().device_name() == "cuda"


@pytest.mark.usefixtures("deepspeed_accelerator")
def test_follow_refuses_a_contradicting_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="DS_ACCELERATOR=cuda"):
        accelerator.follow("cpu")
