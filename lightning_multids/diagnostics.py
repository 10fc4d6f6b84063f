"""What the engines do that user code cannot see: gradient reductions counted, gradient readers warned.

:class:`ReductionCounter` is used by the tests and the GradCache benchmark; also handy to check that a
training step reduces each engine's gradients as often as intended (once per step inside
``strategy.no_sync``). :func:`warn_gradient_readers` runs at setup.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from deepspeed import DeepSpeedEngine
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

_REDUCTION_METHOD = {
    # stage: (object, method) called once per reduction round (per bucket at ZeRO-2/3)
    0: ("engine", "buffered_allreduce_fallback"),
    1: ("optimizer", "reduce_gradients"),
    2: ("optimizer", "average_tensor"),
    3: ("optimizer", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"),
}


class ReductionCounter:
    """Within the ``with`` block, count each engine's gradient reductions across ranks.

    A reduction is one all-reduce (stage 0/1, in ``step()``) or one bucket reduce-scatter (stage 2/3,
    during backward); a model larger than DeepSpeed's ``reduce_bucket_size`` takes several buckets per
    round. ``counts`` maps engine name to the number seen on this rank.
    """

    def __init__(self, engines: Mapping[str, DeepSpeedEngine]) -> None:
        self.engines = dict(engines)
        self.counts = dict.fromkeys(self.engines, 0)
        self._patched: list[tuple[Any, str]] = []

    def __enter__(self) -> ReductionCounter:
        for name, engine in self.engines.items():
            owner, method = _REDUCTION_METHOD[engine.zero_optimization_stage()]
            target = engine if owner == "engine" else engine.optimizer
            original = getattr(target, method)
            setattr(target, method, functools.partial(self._counted, name, original))
            self._patched.append((target, method))
        return self

    def _counted(self, name: str, original: Any, *args: Any, **kwargs: Any) -> Any:
        self.counts[name] += 1
        return original(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        for target, method in self._patched:
            delattr(target, method)  # the class's method shows through again
        self._patched.clear()


_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def _overridden(module: pl.LightningModule, hook: str) -> bool:
    return getattr(type(module), hook) is not getattr(pl.LightningModule, hook)


def warn_gradient_readers(module: pl.LightningModule, engines: Mapping[str, DeepSpeedEngine]) -> None:
    """Warn where user hooks would read ``param.grad`` that ZeRO-2/3 leaves None, or would never be called.

    Args:
        module: the LightningModule.
        engines: its trainable engines by name.
    """
    partitioned = sorted(name for name, e in engines.items() if e.zero_optimization_partition_gradients())
    readers = [hook for hook in _GRADIENT_HOOKS if _overridden(module, hook)]
    name = type(module).__name__
    if partitioned and readers:
        rank_zero_warn(
            f"`{name}` overrides {', '.join(f'`{h}`' for h in readers)}: the ZeRO-2/3 engines {partitioned} keep only "
            "their reduced partition, so `param.grad` is None between backward and step (Lightning's `grad_norm` "
            "returns nothing). Read `self.trainer.strategy.full_gradients(name)` there instead."
        )
    if not _overridden(module, "configure_gradient_clipping"):
        return
    if not module.automatic_optimization:
        rank_zero_warn(
            f"`{name}` overrides `configure_gradient_clipping`, which Lightning calls only in automatic optimization; "
            f"`{name}` runs manual optimization ({len(engines)} engines). Clip in `training_step` with "
            "`self.clip_gradients(opt, gradient_clip_val=...)` before `opt.step()`."
        )
    elif partitioned:
        rank_zero_warn(
            f"`{name}` overrides `configure_gradient_clipping`: only `self.clip_gradients(...)` calls in it take "
            f"effect (DeepSpeed clips inside `step()`); `param.grad` is None there for the ZeRO-2/3 engines "
            f"{partitioned}."
        )
