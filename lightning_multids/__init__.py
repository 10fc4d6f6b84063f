"""lightning_multids: one DeepSpeed engine per submodule of a LightningModule.

The public API: :class:`MultiDeepSpeedStrategy` (also ``Trainer(strategy="multi_deepspeed")``, registered on
import as Lightning's own strategies are), :func:`export` and :func:`consolidated_state_dicts`
(:mod:`lightning_multids.checkpoint`), :mod:`lightning_multids.utilities`, and the ``lightning-multids`` command
(:mod:`lightning_multids.cli`). Each public module lists its names in ``__all__``; modules whose names start
with an underscore are the strategy's own and may change in any release.
"""

from lightning_multids._environment import quiet_accelerator_guess

try:
    with quiet_accelerator_guess():
        import deepspeed  # noqa: F401  (a hard requirement: the strategy is DeepSpeed engines)
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ModuleNotFoundError(
        "lightning_multids needs DeepSpeed, which could not be imported "
        f"({error}). Install it with `pip install 'deepspeed>=0.19.8,<0.20'` (after torch)."
    ) from error

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402  (after DeepSpeed, quietly imported)

from lightning_multids.checkpoint import consolidated_state_dicts, export  # noqa: E402
from lightning_multids.strategy import MultiDeepSpeedStrategy  # noqa: E402

__all__ = ["MultiDeepSpeedStrategy", "consolidated_state_dicts", "export"]
__version__ = "0.1.0"

if MultiDeepSpeedStrategy.strategy_name not in StrategyRegistry:
    MultiDeepSpeedStrategy.register_strategies(StrategyRegistry)
