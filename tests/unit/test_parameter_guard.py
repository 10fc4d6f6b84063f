"""``ParameterGuard``: a check on ``param.grad``/``param.data`` while enabled, and the parameters' class back after."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

from lightning_multids._blocks import note_partitioned_use, refuse_partitioned_weights
from lightning_multids._compat.torch import ParameterGuard


def refuse(param: torch.Tensor, reader: str, verb: str) -> None:
    raise RuntimeError(f"{verb} from {reader}")


def test_a_check_runs_while_enabled_and_not_suspended_and_the_class_comes_back() -> None:
    layer = nn.Linear(2, 2)
    guard = ParameterGuard(list(layer.parameters()), {"grad": refuse})
    assert type(layer.weight) is nn.Parameter, "nothing enabled: the parameter keeps its class"
    guard.enable("grad")
    with pytest.raises(RuntimeError, match=f"read from {__name__}"):
        layer.weight.grad  # noqa: B018
    with pytest.raises(RuntimeError, match=f"set from {__name__}"):
        layer.weight.grad = torch.zeros(2, 2)
    assert layer.weight.data.shape == (2, 2), "an attribute without a check passes"
    with guard.suspended():
        assert layer.weight.grad is None and type(layer.weight) is nn.Parameter
    copied = copy.deepcopy(layer)
    assert type(copied.weight) is nn.Parameter and copied.weight.grad is None, "a copy is not guarded"
    assert isinstance(layer.weight, nn.Parameter) and repr(type(layer.weight)) == repr(nn.Parameter)
    assert torch.equal(pickle.loads(pickle.dumps(layer)).weight, layer.weight)
    guard.close()
    assert type(layer.weight) is nn.Parameter and layer.weight.grad is None


def test_a_zero3_weight_is_refused_to_user_code_unless_a_submodule_holding_it_runs() -> None:
    check = refuse_partitioned_weights("critic")
    weight = nn.Parameter(torch.zeros(0))
    weight.ds_active_sub_modules = set()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"`param.data` of a parameter of engine 'critic' \(ZeRO-3\) was read"):
        check(weight, "my_module", "read")
    check(weight, "deepspeed.runtime.zero.partition_parameters", "set")  # DeepSpeed's own
    weight.ds_active_sub_modules.add(7)  # type: ignore[attr-defined]
    check(weight, "my_module", "read")  # in its submodule's forward: whole
    with pytest.raises(RuntimeError, match=r"was set outside its forward"):
        check(weight, "my_module", "set")


def test_setting_data_to_itself_changes_nothing_and_passes() -> None:
    """pytorch-metric-learning's losses run ``self.W.data = c_f.to_device(self.W.data, ...)`` in each forward."""
    layer = nn.Linear(2, 2)
    guard = ParameterGuard(list(layer.parameters()), {"data": refuse})
    guard.enable("data")
    with guard.suspended():
        same = layer.weight.data
    layer.weight.data = same  # the same memory, shape and dtype: no check
    with pytest.raises(RuntimeError, match=f"set from {__name__}"):
        layer.weight.data = same.clone()
    with pytest.raises(RuntimeError, match=f"set from {__name__}"):
        layer.weight.data = same.t()  # the same memory, other strides: a change
    guard.close()


class _Zero3Engine:
    """What ``note_partitioned_use`` reads of a ZeRO-3 engine: its module and that it partitions its weights."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def zero_optimization_partition_weights(self) -> bool:
        return True


def _partitioned_layer() -> nn.Linear:
    layer = nn.Linear(2, 2)
    layer.weight.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    return layer


def _average(shadow: torch.Tensor, params: object, error: type[Exception] = RuntimeError) -> None:
    for param in params:  # type: ignore[attr-defined]  # a frame of user code holding the parameter as a local
        if error is not RuntimeError:
            raise error("not a computation")
        shadow.sub_(param)


@pytest.mark.parametrize(
    ("error", "noted"), [(RuntimeError, True), (ValueError, False)], ids=["shape_error", "other_error"]
)
def test_an_error_where_user_code_held_an_empty_partition_gets_a_note(error: type[Exception], noted: bool) -> None:
    layer = _partitioned_layer()
    layer.weight.data = torch.empty(0)
    with pytest.raises(error) as caught:
        _average(torch.zeros(2, 2), [layer.weight], error)
    note_partitioned_use(caught.value, {"net": _Zero3Engine(layer)})  # type: ignore[dict-item]
    notes = getattr(caught.value, "__notes__", [])
    assert bool(notes) is noted, notes
    if noted:
        assert "`param` in _average" in notes[0] and "`weight` of engine 'net' (ZeRO-3)" in notes[0], notes
        assert "gathered('net')" in notes[0], notes


def test_no_note_where_only_torch_held_the_partition() -> None:
    layer = _partitioned_layer()
    layer.weight.data = torch.empty(0)
    with pytest.raises(RuntimeError) as caught:
        torch.zeros(2, 2).sub_(layer.weight)  # no frame of user code holds it as a local
    note_partitioned_use(caught.value, {"net": _Zero3Engine(layer)})  # type: ignore[dict-item]
    assert not getattr(caught.value, "__notes__", []), "a note needs a local of user code to name"


def _unrelated_error(params: list[nn.Parameter]) -> None:
    param = params[0]  # a local of the frame that raises, as a loop's variable stays bound after the loop
    raise RuntimeError(f"my own data pipeline error ({param.dtype})")


def _foreach_average(shadows: list[torch.Tensor], params: list[nn.Parameter]) -> None:
    torch._foreach_sub_(shadows, params)  # diffusers' EMAModel(foreach=True).step: the parameters only in a list


def test_the_note_keeps_to_errors_about_empty_tensors_and_finds_parameters_in_lists() -> None:
    layer = _partitioned_layer()
    layer.weight.data = torch.empty(0)
    engines = {"net": _Zero3Engine(layer)}
    with pytest.raises(RuntimeError) as unrelated:
        _unrelated_error([layer.weight])
    note_partitioned_use(unrelated.value, engines)  # type: ignore[arg-type]
    assert not getattr(unrelated.value, "__notes__", []), "an error of another kind is not blamed on the partition"
    with pytest.raises(RuntimeError) as listed:
        _foreach_average([torch.zeros(2, 2)], [layer.weight])
    note_partitioned_use(listed.value, engines)  # type: ignore[arg-type]
    notes = getattr(listed.value, "__notes__", [])
    assert notes and "`params[0]` in _foreach_average" in notes[0], notes
