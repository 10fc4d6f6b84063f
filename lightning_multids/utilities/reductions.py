"""Count each engine's gradient reductions: for tests, benchmarks, and checking a training step's communication.

A training step that means to reduce once per engine (inside ``strategy.no_sync``, or GradCache) can be
checked with :class:`ReductionCounter`. It patches DeepSpeed's reduction method per engine while active
(which method: :func:`lightning_multids._compat.deepspeed.reduction_call`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from deepspeed import DeepSpeedEngine

from lightning_multids._compat.deepspeed import reduction_call

__all__ = ["ReductionCounter"]


class ReductionCounter:
    """Within the ``with`` block, count each engine's gradient reductions across ranks.

    A reduction is one all-reduce (stage 0/1, in ``step()``) or one bucket reduce-scatter (stage 2/3,
    during backward); a model larger than DeepSpeed's ``reduce_bucket_size`` takes several buckets per
    round. ``counts`` maps engine name to the number seen on this rank.

    Args:
        engines: the engines to count, by name (``trainer.strategy.engines``).
    """

    def __init__(self, engines: Mapping[str, DeepSpeedEngine]) -> None:
        self.engines = dict(engines)
        self.counts = dict.fromkeys(self.engines, 0)
        self._patched: list[tuple[Any, str]] = []

    def __enter__(self) -> ReductionCounter:
        for name, engine in self.engines.items():
            target, method = reduction_call(engine)
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
