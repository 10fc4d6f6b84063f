"""``strategy.offloaded`` refusals that need no process group: no names, and an engine with offloaded parameters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from lightning_multids._blocks import offloaded
from tests.fakes import engine_set, fake_optimizer


class Engine:
    """What ``offloaded`` reads of a DeepSpeed engine before it moves anything."""

    def __init__(self, stage: int, offload_param: Any = None) -> None:
        self.stage, self.offload_param = stage, offload_param

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_offload_param(self) -> Any:
        return self.offload_param


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
