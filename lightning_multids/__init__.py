"""lightning_multids: one DeepSpeed engine per submodule of a LightningModule."""

try:
    import deepspeed  # noqa: F401  (a hard requirement: the strategy is DeepSpeed engines)
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ModuleNotFoundError(
        "lightning_multids needs DeepSpeed, which could not be imported "
        f"({error}). Install it with `pip install 'deepspeed>=0.19.8,<0.20'` (after torch)."
    ) from error

from lightning.pytorch.strategies import StrategyRegistry

from lightning_multids.strategy import MultiDeepSpeedStrategy

__all__ = ["MultiDeepSpeedStrategy"]
__version__ = "0.1.0"

if MultiDeepSpeedStrategy.strategy_name not in StrategyRegistry:
    MultiDeepSpeedStrategy.register_strategies(StrategyRegistry)
