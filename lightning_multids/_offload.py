"""Engines put to sleep for a block: their states moved off the device, and back when the block ends.

RLHF alternates phases: while the actor generates, the critic's optimizer states, master weights and
gradient buffers sit idle on the device. :func:`offloaded` moves them to host memory with DeepSpeed's
``engine.offload_states()`` and back with ``engine.reload_states()`` (what OpenRLHF does between phases).
The engine can neither run nor step inside the block: its weights are among what moved.

DeepSpeed 0.19.8 moves the states of ZeRO-1/2 optimizers, and of ZeRO-3 ones only when the optimizer is its
``FusedAdam`` (a CUDA op); it has nothing to move for a frozen engine and refuses engines that offload their
parameters (``offload_param``). Those are refused here, naming the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from deepspeed import DeepSpeedEngine
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._optimizer import EngineOptimizer


@contextmanager
def offloaded(names: tuple[str, ...], optimizers: list[EngineOptimizer], frozen: set[str]) -> Iterator[None]:
    """Move the states of the trainable engines ``names`` off the device for the block; reload them after it.

    Raises:
        ValueError: a name is not a trainable engine, an engine is already offloaded, or DeepSpeed cannot move
            its states (see the module's docstring).
    """
    chosen = _choose(names, optimizers, frozen)
    with ExitStack() as stack:
        for optimizer in chosen:
            stack.enter_context(_asleep(optimizer))
        yield


def _choose(names: tuple[str, ...], optimizers: list[EngineOptimizer], frozen: set[str]) -> list[EngineOptimizer]:
    by_name = {optimizer.name: optimizer for optimizer in optimizers if optimizer.engine is not None}
    if not names:
        raise ValueError(f"`offloaded()` needs the names of the engines to offload, e.g. {sorted(by_name)}.")
    chosen = []
    for name in names:
        if name not in by_name:
            reason = " (a frozen engine has no optimizer states: offload its parameters with ZeRO-3's `offload_param`)"
            raise ValueError(
                f"`offloaded({name!r})`: there is no trainable engine {name!r}{reason if name in frozen else ''}. "
                f"Trainable engines exist during fit: {sorted(by_name)}."
            )
        optimizer = by_name[name]
        if optimizer.inside:
            raise ValueError(
                f"`offloaded({name!r})`: the engine is inside `{optimizer.inside}` already; don't nest them."
            )
        _check_supported(name, optimizer.engine)
        chosen.append(optimizer)
    return chosen


def _check_supported(name: str, engine: DeepSpeedEngine) -> None:
    stage = engine.zero_optimization_stage()
    offload_param = engine.zero_offload_param()
    problem = ""
    if stage == 0:
        problem = "it is at ZeRO-0, whose optimizer DeepSpeed cannot move; give it stage 1, 2 or 3"
    elif offload_param is not None and offload_param.device != OffloadDeviceEnum.none:
        problem = "its parameters are offloaded already (`offload_param`), which DeepSpeed refuses to combine"
    elif stage == 3 and not isinstance(ds_compat.torch_optimizer(engine), FusedAdam):
        problem = (
            "it is at ZeRO-3, where DeepSpeed moves optimizer states only of its own FusedAdam (a CUDA op: "
            "`deepspeed.ops.adam.FusedAdam` in `configure_optimizers`, or an `optimizer` section in its config); "
            "or give it stage 1 or 2"
        )
    if problem:
        raise ValueError(f"`offloaded({name!r})`: DeepSpeed cannot move the engine's states: {problem}.")


@contextmanager
def _asleep(optimizer: EngineOptimizer) -> Iterator[None]:
    engine = optimizer.engine
    pin = engine.device.type == "cuda"  # pinned host memory makes the copies back faster; a CPU has none
    engine.offload_states(pin_memory=pin)
    optimizer.inside = f"strategy.offloaded({optimizer.name!r})"
    handle = _refuse_forward(optimizer.name, engine.module)
    try:
        yield
    finally:
        handle.remove()
        optimizer.inside = ""
        engine.reload_states()


def _refuse_forward(name: str, module: nn.Module) -> RemovableHandle:
    def refuse(*args: Any) -> None:
        raise RuntimeError(
            f"`self.{name}` was called inside `strategy.offloaded({name!r})`, where its weights and optimizer states "
            "are off the device. Call it after the block, or leave it out of `offloaded(...)`."
        )

    return module.register_forward_pre_hook(refuse)
