"""Route one ``loss.backward()`` through the backward prologue and epilogue of every engine it reaches.

DeepSpeed drives a backward with two pieces of per-engine state machinery:

* the *prologue* (``DeepSpeedEngine._backward_prologue``): enter the ZeRO optimizer's backward
  context, set the accumulation boundary on the optimizer, queue a post-backward callback;
* the *epilogue* (``DeepSpeedEngine._backward_epilogue``): reduce (stage 0/1 at the boundary) or
  finish reducing (stage 2/3) the gradients, then leave the backward context.

Left to itself, DeepSpeed runs the prologue from tensor hooks that ``engine.forward`` registers on
every output and the epilogue from an autograd callback. That is correct for one forward per engine
per backward, and wrong for the patterns people write in GANs (DeepSpeed 0.19, measured):

* an engine called twice before one backward (``D(real)``, ``D(fake)``) runs the prologue twice,
  its backward depth reaches 2 and the epilogue is skipped: nothing is reduced;
* a loss that flows through a second trained engine (``D(G(z))`` backpropagated for ``G``) reduces
  ``D``'s gradients without ``D``'s epilogue, so ``D``'s next backward fails;
* a chained loss divides ``G``'s gradients by the accumulation steps once per engine it crosses.

So the strategy takes explicit control instead. Submodules are called directly (never through
``engine.forward``), which registers no output hooks and no per-forward prologue; ``backward``
below finds the trainable engines whose parameters the loss reaches by walking its autograd graph,
runs each one's prologue exactly once, runs ``loss.backward()`` once, then each one's epilogue
exactly once. Marking each engine as "inside engine.backward" tells DeepSpeed's own post-backward
callback to leave the epilogue to us, exactly as ``DeepSpeedEngine.backward`` does for itself.
What still comes from DeepSpeed's hooks: the ZeRO per-parameter gradient hooks (bucketing and
reduce-scatter at stage 2/3) and the ZeRO-3 module hooks that gather and release parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from lightning_multids.sync import is_deferred


def reached_engines(loss: torch.Tensor, owners: Mapping[int, str]) -> list[str]:
    """Return the names of the engines whose parameters receive a gradient from ``loss``.

    Args:
        loss: the tensor ``backward`` will be called on.
        owners: ``id(parameter) -> engine name`` for every trainable engine parameter.

    The walk visits each autograd node once and stops early when every engine has been found.
    """
    wanted = set(owners.values())
    found: dict[str, None] = {}
    root = loss.grad_fn
    if root is None:
        return []
    seen: set[int] = {id(root)}
    stack = [root]
    while stack and len(found) < len(wanted):
        node = stack.pop()
        variable = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if variable is not None:
            name = owners.get(id(variable))
            if name is not None:
                found.setdefault(name)
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return list(found)


@dataclass
class _Phases:
    """Where one engine is in a routed backward: the root graph task, and gradients not yet reduced."""

    root_task: int = -1
    pending: bool = False
    ended: set[int] = field(default_factory=set)


_ACTIVE: dict[int, _Phases] = {}
"""``id(engine) -> _Phases`` for the engines inside a routed backward right now."""


def watch_phases(engine: DeepSpeedEngine) -> None:
    """Hook ``engine``'s trainable parameters so a routed backward sees when their gradients arrive.

    Under reentrant activation checkpointing every checkpointed segment runs its own nested backward
    (its own autograd graph task). A parameter used in two segments (a checkpointed discriminator
    called on real and on fake data) then receives its gradient twice in one backward, which ZeRO-2/3
    can only reduce if an epilogue runs in between. DeepSpeed's post-backward callback runs once, at
    the end of the outer graph task, so the strategy closes each nested phase itself.
    """
    for param in engine.module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(functools.partial(_on_gradient, engine))


def _on_gradient(engine: DeepSpeedEngine, param: torch.Tensor) -> None:
    phases = _ACTIVE.get(id(engine))
    if phases is None:
        return
    phases.pending = True
    task = torch._C._current_graph_task_id()
    if task in (phases.root_task, -1) or task in phases.ended:
        return
    phases.ended.add(task)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_phase(engine, phases))


def _end_phase(engine: DeepSpeedEngine, phases: _Phases) -> None:
    """At the end of a nested graph task: reduce-scatter what arrived (ZeRO-2/3) before more arrives.

    Only the reduction runs here, not the whole epilogue: ZeRO-3's also releases every submodule
    still on the backward stack, which the outer backward needs. At stage 0/1 a backward only
    accumulates locally, so a gradient arriving twice needs nothing.
    """
    if not phases.pending or is_deferred(engine):  # deferred: the gradients accumulate locally
        return
    phases.pending = False
    if engine.zero_optimization_partition_gradients():
        engine.optimizer.overlapping_partition_gradients_reduce_epilogue()
        # ZeRO-3 then accumulates (micro_step_id > 0) instead of overwriting what this phase reduced.
        engine.optimizer.clear_backward_seen_flag()


@contextmanager
def _engine_backward(engine: DeepSpeedEngine, phases: _Phases) -> Iterator[None]:
    """Run ``engine``'s prologue on entry and its epilogue on a clean exit, as ``engine.backward`` does.

    ``_running_engine_backward`` makes DeepSpeed's queued post-backward callback skip the epilogue
    (``DeepSpeedEngine._backward_post_hook``) and lets stage 0 accept a direct ``tensor.backward()``.
    The hook counters are reset first, as ``engine.forward`` would before its backward.
    """
    with engine._running_engine_backward_lock:
        engine._running_engine_backward_count += 1
        engine._running_engine_backward = True
    _ACTIVE[id(engine)] = phases
    try:
        if isinstance(engine.optimizer, ZeROOptimizer):
            engine.optimizer.clear_backward_seen_flag()
        engine._backward_prologue()
        yield
        engine._backward_epilogue()
    finally:
        _ACTIVE.pop(id(engine), None)
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count -= 1
            engine._running_engine_backward = engine._running_engine_backward_count > 0


@contextmanager
def engines_backward(loss: torch.Tensor, engines: Iterable[DeepSpeedEngine]) -> Iterator[None]:
    """Run the body (one ``loss.backward()``) inside the prologue/epilogue of each engine in ``engines``."""
    phases = {id(engine): _Phases() for engine in engines}

    def record_root(grad: torch.Tensor) -> torch.Tensor:
        for state in phases.values():
            state.root_task = torch._C._current_graph_task_id()
        return grad

    handle = loss.register_hook(record_root) if loss.requires_grad else None
    try:
        with ExitStack() as stack:
            for engine in engines:
                stack.enter_context(_engine_backward(engine, phases[id(engine)]))
            yield
    finally:
        if handle is not None:
            handle.remove()


def loss_scale(engine: DeepSpeedEngine) -> float:
    """The factor ``engine``'s optimizer divides gradients by in ``step()``: its fp16 loss scale, else 1."""
    if not engine.fp16_enabled():
        return 1.0
    scale: Any = getattr(engine.optimizer, "loss_scale", None)  # ZeRO optimizers
    if scale is None:
        scale = getattr(engine.optimizer, "cur_scale", 1.0)  # FP16_Optimizer (stage 0)
    return float(scale)


def loss_scaling(engines: Mapping[str, DeepSpeedEngine]) -> tuple[float, dict[str, float]]:
    """How to scale one loss that reaches ``engines``: the loss factor, and a gradient factor per engine.

    Each fp16 engine's optimizer divides its gradients by its own dynamic loss scale in ``step()``; bf16
    and fp32 engines divide by nothing. The loss is multiplied by the smallest fp16 scale S (so no
    engine's backward runs at a larger scale than its own scaler allows), and each engine's parameter
    gradients by ``its scale / S`` as they arrive, so every engine sees its gradients at its own scale.
    """
    scales = {name: loss_scale(engine) for name, engine in engines.items()}
    fp16 = [scale for name, scale in scales.items() if engines[name].fp16_enabled()]
    common = min(fp16) if fp16 else 1.0
    return common, {name: scale / common for name, scale in scales.items()}


@contextmanager
def gradients_rescaled(engines: Mapping[str, DeepSpeedEngine], factors: Mapping[str, float]) -> Iterator[None]:
    """Multiply the gradient of each parameter of ``engines[name]`` by ``factors[name]`` during the body."""
    handles = []
    for name, factor in factors.items():
        if factor != 1.0:
            for param in engines[name].module.parameters():
                if param.requires_grad:
                    handles.append(param.register_hook(functools.partial(torch.mul, other=factor)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
