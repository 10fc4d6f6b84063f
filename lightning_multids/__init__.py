"""lightning_multids: one DeepSpeed engine per submodule of a LightningModule."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_multids.strategy import MultiDeepSpeedStrategy

__all__ = ["MultiDeepSpeedStrategy"]
__version__ = "0.1.0"

if MultiDeepSpeedStrategy.strategy_name not in StrategyRegistry:
    MultiDeepSpeedStrategy.register_strategies(StrategyRegistry)
