"""Old import paths and argument names that still work, with a deprecation warning, until they are removed."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation


def moved_module(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old``: each public name is read from ``new``, with a warning."""

    def __getattr__(name: str) -> Any:
        module = importlib.import_module(new)
        if name.startswith("_") or not hasattr(module, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        rank_zero_deprecation(
            f"`{old}.{name}` is deprecated and will be removed in a future release of lightning_multids. "
            f"Import it from `{new}` instead."
        )
        return getattr(module, name)

    return __getattr__


def engine_configs_argument(
    engine_configs: dict[str, dict[str, Any] | str] | None, engines: dict[str, dict[str, Any] | str] | None
) -> dict[str, dict[str, Any] | str]:
    """The per-engine configs, from ``engine_configs`` or its deprecated name ``engines``."""
    if engines is None:
        return engine_configs or {}
    if engine_configs is not None:
        raise ValueError(
            "MultiDeepSpeedStrategy got both `engine_configs=` and `engines=`, the deprecated name of the same "
            "argument. Pass the per-engine configs once, as `engine_configs=`."
        )
    rank_zero_deprecation(
        "`MultiDeepSpeedStrategy(engines=...)` is deprecated and will be removed in a future release: the argument "
        "takes configs, while `strategy.engines` returns engines. Pass `engine_configs=...` instead (in YAML, "
        "`engine_configs:` under the strategy's `init_args`)."
    )
    return engines
