"""Counting what the engines communicate: how many gradient reductions each engine makes.

Used by the tests and the GradCache benchmark; also handy to check that a training step reduces each
engine's gradients as often as intended (once per step inside ``strategy.no_sync``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from deepspeed import DeepSpeedEngine

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
