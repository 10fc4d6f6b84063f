"""Stand-ins for what the unit tests need of DeepSpeed and of a fit: fake engines, fake optimizers, engine sets.

The library builds an :class:`~lightning_multids._engines.EngineSet` of real engines at setup; :func:`engine_set`
builds one of stand-ins through the same records, so the library has no case of its own for tests.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from torch import nn

from lightning_multids._engines import EngineSet
from lightning_multids._record import EngineRecord


class FakeEngine:
    """What the routing code touches of a DeepSpeed engine, recording prologue and epilogue calls."""

    def __init__(self, name: str, module: nn.Module, calls: list[tuple[str, str]]) -> None:
        self.name, self.module, self.calls = name, module, calls
        self.optimizer: Any = None
        self._running_engine_backward_lock = threading.Lock()
        self._running_engine_backward_count = 0
        self._running_engine_backward = False

    def _backward_prologue(self) -> None:
        assert self._running_engine_backward
        self.calls.append(("prologue", self.name))

    def _backward_epilogue(self) -> None:
        assert self._running_engine_backward
        self.calls.append(("epilogue", self.name))

    def zero_grad(self) -> None:
        self.calls.append(("cleared", self.name))

    def zero_optimization_partition_gradients(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        return 0

    def fp16_enabled(self) -> bool:
        return False


def fake_optimizer(name: str, **attributes: Any) -> SimpleNamespace:
    """What the engine set reads of an engine's optimizer for Lightning: its name."""
    return SimpleNamespace(name=name, **attributes)


def engine_set(
    engines: Mapping[str, Any] | None = None,
    optimizers: Sequence[Any] = (),
    owners: Mapping[int, str] | None = None,
    watched: bool = False,
) -> EngineSet:
    """An engine set of already built (stand-in) engines and their optimizers, matched by name.

    An optimizer whose name has no engine in ``engines`` is recorded with its own ``engine`` where it has one,
    else with a :class:`FakeEngine` of no parameters. With ``watched`` the router watches every engine, as setup
    has it do.
    """
    records = {name: EngineRecord(name, engine) for name, engine in (engines or {}).items()}
    for optimizer in optimizers:
        name = optimizer.name
        if name not in records:
            records[name] = EngineRecord(name, getattr(optimizer, "engine", None) or FakeEngine(name, nn.Module(), []))
        records[name].trainable = True
    optimizer_of = {optimizer.name: optimizer for optimizer in optimizers}
    result = EngineSet(records=records, optimizer_of=optimizer_of, owners=dict(owners or {}))
    if watched:
        for name, record in records.items():
            result.router.watch(name, record.engine)
    return result


def routed_engine_set(engines: Mapping[str, FakeEngine]) -> EngineSet:
    """Every engine trainable, owning its module's parameters, and watched by the router."""
    owners = {id(p): name for name, engine in engines.items() for p in engine.module.parameters()}
    return engine_set(engines, [fake_optimizer(name) for name in engines], owners, watched=True)
