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
``engine.forward``), which registers no output hooks and no per-forward prologue. :func:`routed`
takes the trainable engines whose parameters the loss's graph reaches (:mod:`lightning_multids.discovery`),
runs each one's prologue exactly once, in name order, runs ``loss.backward()`` once, then each one's
epilogue exactly once, in name order (the same collective order on every rank). An engine hidden behind a
reentrant checkpoint is entered when its first gradient arrives (:func:`watch_gradients`).
Marking each engine as "inside engine.backward" tells DeepSpeed's own post-backward callback to leave
the epilogue to us, exactly as ``DeepSpeedEngine.backward`` does for itself.
What still comes from DeepSpeed's hooks: the ZeRO per-parameter gradient hooks (bucketing and
reduce-scatter at stage 2/3) and the ZeRO-3 module hooks that gather and release parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from torch.utils.hooks import RemovableHandle

from lightning_multids.discovery import Reach
from lightning_multids.sync import abandon_backward, is_deferred, loss_scale, reduction_skipped


@dataclass
class _Phases:
    """Where one engine is in a routed backward: gradients not yet reduced, and nested graph tasks closed."""

    pending: bool = False
    ended: set[int] = field(default_factory=set)


@dataclass
class Route:
    """One routed backward: every trainable engine by name, and the ones entered so far.

    Engines are entered (prologue) before the backward in name order, and any engine whose first
    gradient arrives during it (behind a reentrant checkpoint) is entered then; epilogues run after it
    in name order. Every rank runs the same code on the same graph, so every rank enters the same
    engines and runs their epilogues (collectives at ZeRO-2/3) in the same order.
    """

    engines: Mapping[str, DeepSpeedEngine]
    entered: dict[str, _Phases] = field(default_factory=dict)
    root_task: int = -1

    def enter(self, name: str) -> _Phases:
        """Run ``name``'s prologue, as ``engine.backward`` does, and mark it as inside a backward.

        ``_running_engine_backward`` makes DeepSpeed's queued post-backward callback skip the epilogue
        (``DeepSpeedEngine._backward_post_hook``) and lets stage 0 accept a direct ``tensor.backward()``.
        The hook counters are reset first, as ``engine.forward`` would before its backward.
        """
        engine = self.engines[name]
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count += 1
            engine._running_engine_backward = True
        phases = self.entered[name] = _Phases()
        if isinstance(engine.optimizer, ZeROOptimizer):
            engine.optimizer.clear_backward_seen_flag()
        engine._backward_prologue()
        return phases

    def finish(self) -> None:
        """Run the epilogue of every entered engine, in name order, after a backward that completed.

        At ZeRO-2, when every gradient was already reduced at the end of a nested phase (an engine wholly
        inside a reentrant checkpoint), the epilogue runs without its reduction: ZeRO-2 cannot reduce an
        empty bucket (IndexError in ``reduce_ipg_grads``, DeepSpeed 0.19.8).
        """
        for name in sorted(self.entered):
            engine, phases = self.engines[name], self.entered[name]
            nothing_left = phases.ended and not phases.pending
            if nothing_left and engine.zero_optimization_stage() == 2 and not is_deferred(engine):
                with reduction_skipped(engine):
                    engine._backward_epilogue()
            else:
                engine._backward_epilogue()

    def abandon(self) -> None:
        """After an exception: reset every entered engine and drop its gradients of this step (no collective)."""
        for name in sorted(self.entered):
            abandon_backward(self.engines[name])

    def leave(self) -> None:
        """Take every entered engine out of the backward, whether or not it completed."""
        for name in self.entered:
            engine = self.engines[name]
            with engine._running_engine_backward_lock:
                engine._running_engine_backward_count -= 1
                engine._running_engine_backward = engine._running_engine_backward_count > 0


_ROUTE: Route | None = None
"""The routed backward running now. Module-global, not thread-local: autograd runs a CUDA backward,
and so the parameter hooks below, on its own device thread."""


def watch_gradients(name: str, engine: DeepSpeedEngine) -> list[RemovableHandle]:
    """Hook ``engine``'s trainable parameters (once, at setup) so a routed backward sees their gradients arrive.

    Returns the hooks' handles, for teardown.

    The hook is a tensor hook, so it runs before the gradient is accumulated and before ZeRO's own
    reduction hooks (which DeepSpeed registers after accumulation). It does two things:

    * it enters the engine if the walk did not (its parameters were behind a reentrant checkpoint);
    * under reentrant activation checkpointing every checkpointed segment runs its own nested backward
      (its own autograd graph task). A parameter used in two segments (a checkpointed discriminator
      called on real and on fake data) then receives its gradient twice in one backward, which ZeRO-2/3
      can only reduce if an epilogue runs in between. DeepSpeed's post-backward callback runs once, at
      the end of the outer graph task, so the strategy closes each nested phase itself.
    """
    return [
        param.register_hook(functools.partial(_on_gradient, name, engine))
        for param in engine.module.parameters()
        if param.requires_grad
    ]


def _on_gradient(name: str, engine: DeepSpeedEngine, grad: torch.Tensor) -> None:
    route = _ROUTE
    if route is None or route.engines.get(name) is not engine:
        return
    phases = route.entered.get(name) or route.enter(name)
    phases.pending = True
    task = torch._C._current_graph_task_id()
    if task in (route.root_task, -1) or task in phases.ended:
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
def routed(loss: torch.Tensor, engines: Mapping[str, DeepSpeedEngine], reach: Reach) -> Iterator[Route]:
    """Run the body (one ``loss.backward()``) inside the prologue/epilogue of every engine it reaches.

    Args:
        loss: the tensor the body backpropagates.
        engines: every trainable engine, by name; each must be watched (:func:`watch_gradients`).
        reach: what the walk found; those engines are entered before the body, in name order.

    On an exception (a CUDA out-of-memory error that the caller may catch and go on from) no epilogue
    runs, since it would reduce on this rank alone: every entered engine is reset and drops its gradients
    of this step (:func:`~lightning_multids.sync.abandon_backward`), and leaves the backward.
    """
    global _ROUTE
    route = Route(engines)

    def record_root(grad: torch.Tensor) -> torch.Tensor:
        route.root_task = torch._C._current_graph_task_id()
        return grad

    handle = loss.register_hook(record_root) if loss.requires_grad else None
    previous, _ROUTE = _ROUTE, route
    try:
        for name in sorted(reach.names):
            route.enter(name)
        yield route
        route.finish()
    except BaseException:
        route.abandon()
        raise
    finally:
        _ROUTE = previous
        route.leave()
        if handle is not None:
            handle.remove()


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
