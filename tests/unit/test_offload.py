"""``strategy.offloaded`` refusals that need no process group: no names, an engine with offloaded parameters or
optimizer states."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from lightning_multids._blocks import offloaded
from tests.fakes import engine_set, fake_optimizer


class Engine:
    """What ``offloaded`` reads of a DeepSpeed engine before it moves anything."""

    def __init__(self, stage: int, offload_param: Any = None, offload_optimizer: Any = None) -> None:
        self.stage, self.offload_param, self.offload_optimizer = stage, offload_param, offload_optimizer

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_offload_param(self) -> Any:
        return self.offload_param

    def zero_offload_optimizer(self) -> Any:
        return self.offload_optimizer


def records(name: str, engine: Engine) -> Any:
    return engine_set({name: engine}, [fake_optimizer(name)]).records


def test_no_names_is_refused_with_the_names_to_choose_from() -> None:
    expected = r"`offloaded\(\)` needs the names of the engines to offload, e.g. \['critic'\]"
    with pytest.raises(ValueError, match=expected), offloaded((), records("critic", Engine(2))):
        pass


def test_an_engine_with_offloaded_parameters_is_refused_by_name() -> None:
    engine = Engine(3, SimpleNamespace(device=OffloadDeviceEnum.cpu))
    expected = r"`offloaded\('actor'\)`: .*its parameters are offloaded already"
    with pytest.raises(ValueError, match=expected), offloaded(("actor",), records("actor", engine)):
        pass


@pytest.mark.parametrize("stage", [1, 2])
def test_an_engine_whose_optimizer_is_offloaded_already_is_refused_by_name(stage: int) -> None:
    engine = Engine(stage, offload_optimizer=SimpleNamespace(device=OffloadDeviceEnum.cpu))
    expected = r"`offloaded\('actor'\)`: .*optimizer states live in host memory already .*leave this engine out"
    with pytest.raises(ValueError, match=expected), offloaded(("actor",), records("actor", engine)):
        pass
