"""The optimizer the module sees for an engine: its param groups, its scheduler, and clipping."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._optimizer import EngineScheduler, _GroupView
from lightning_multids._planning import ELEMENTWISE_OPTIMIZERS, is_elementwise, optimizer_class
from lightning_multids._record import EngineRecord
from tests.unit.test_discovery import sgd


def test_group_view_shows_module_parameters_and_writes_hyperparameters_through() -> None:
    params = list(nn.Linear(2, 2).parameters())
    group = {"params": [torch.zeros(6)], "lr": 0.1}
    view = _GroupView(group, params)
    assert view["params"] is params
    view["lr"] = 0.5
    assert group["lr"] == 0.5
    assert set(view) == {"params", "lr"}
    with pytest.raises(ValueError, match=r"fixed when the engine is built.*configure_optimizers"):
        view["params"] = []


def test_engine_scheduler_refuses_a_second_step_and_reads_the_real_one() -> None:
    optimizer = sgd(nn.Parameter(torch.ones(1)))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    visible = EngineScheduler("generator", scheduler)
    assert visible.get_last_lr() == [0.1]
    with pytest.raises(ValueError, match=r"engine 'generator' is stepped by its optimizer.*Remove the"):
        visible.step()


def test_clipping_by_value_in_manual_optimization_is_refused() -> None:
    from lightning_multids._optimizer import EngineOptimizer
    from lightning_multids._precision import EnginePrecision

    module = nn.Linear(2, 2)
    engine = SimpleNamespace(module=module, fp16_enabled=lambda: False, optimizer=None)
    record = EngineRecord("critic", engine, trainable=True)  # type: ignore[arg-type]
    optimizer = EngineOptimizer(record, sgd(*module.parameters()), [list(module.parameters())])
    with pytest.raises(ValueError, match=r"engine 'critic' by value is not available.*gradient_clip_algorithm='norm'"):
        EnginePrecision().clip_gradients(optimizer, 0.5, "value")  # type: ignore[arg-type]


def test_clipping_an_optimizer_that_is_not_an_engines_is_a_type_error_naming_the_fix() -> None:
    from lightning_multids._precision import EnginePrecision

    plain = sgd(nn.Parameter(torch.ones(1)))
    with pytest.raises(TypeError, match=r"got SGD, not an optimizer of this strategy's engines.*self.optimizers\(\)"):
        EnginePrecision().clip_gradients(plain, 0.5)  # type: ignore[arg-type]


def test_repr_names_the_engine_and_shows_the_optimizer_as_torch_does() -> None:
    from lightning_multids._optimizer import EngineOptimizer

    module = nn.Linear(2, 2)
    engine = SimpleNamespace(module=module, fp16_enabled=lambda: False, optimizer=None)
    inner = torch.optim.Adam(module.parameters(), lr=0.01)
    optimizer = EngineOptimizer(EngineRecord("critic", engine), inner, [list(module.parameters())])  # type: ignore[arg-type]
    assert repr(optimizer) == f"EngineOptimizer(engine='critic') over {inner!r}"
    assert "Adam (\nParameter Group 0\n" in repr(optimizer) and "lr: 0.01\n" in repr(optimizer)
    # what `self.optimizers()` gives: Lightning's name, the rest once (Lightning's test of its wrapper expects that)
    assert str(LightningOptimizer(optimizer)) == "Lightning" + str(optimizer)


class _OwnStep(torch.optim.Adam):
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        pass


class _SameStep(torch.optim.Adam):
    pass


def test_a_subclass_is_element_wise_only_where_it_keeps_its_bases_step() -> None:
    for kind in (_OwnStep, _SameStep, torch.optim.Adam):
        kind([nn.Parameter(torch.ones(1))])  # torch wraps the class's step at its first instance
    assert is_elementwise(torch.optim.Adam, ELEMENTWISE_OPTIMIZERS)
    assert is_elementwise(_SameStep, ELEMENTWISE_OPTIMIZERS)
    assert not is_elementwise(_OwnStep, ELEMENTWISE_OPTIMIZERS)
    assert not is_elementwise(torch.optim.Adafactor, ELEMENTWISE_OPTIMIZERS)
    assert is_elementwise(_OwnStep, [optimizer_class(f"{__name__}._OwnStep")])


@pytest.mark.parametrize(
    ("kind", "message"),
    [("no_such_package.Adam", r"no class at that path.*full import path"), ("torch.nn.Linear", r"not a `torch.optim")],
)
def test_a_declared_optimizer_that_is_not_one_is_refused_at_construction(kind: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"elementwise_optimizers=\[{kind!r}\].*{message}"):
        MultiDeepSpeedStrategy(elementwise_optimizers=[kind])


def test_only_parameters_the_optimizer_steps_are_kept_from_a_step() -> None:
    """Parameters frozen when the engine was built (a LoRA base) have nothing to keep: no copy at any step."""
    record = EngineRecord("net", SimpleNamespace(), trainable=True)  # type: ignore[arg-type]
    record.stepped = frozenset({0, 1})
    record.has_gradients = True
    record.note_reach([2])  # the frozen base only
    assert record.without_gradient == set()
    assert record.hold_untouched() is None
    record.has_gradients = False
    record.has_gradients = True
    record.note_reach([1, 2])
    record.note_reach([1])
    assert record.without_gradient == {1}
    record.note_reach([])  # a later backward reached it
    assert record.without_gradient == set()
