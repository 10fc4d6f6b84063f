"""The precision plugin of the strategy: precision and clipping belong to each engine's DeepSpeed config."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from lightning_multids.optimizer import EngineOptimizer


class EnginePrecision(Precision):
    """Keeps the Trainer's ``precision`` flag for the engine configs and leaves tensors alone.

    Lightning picks autocast (``MixedPrecision``) for ``bf16-mixed`` on a DDP-like strategy; here each
    DeepSpeed engine runs its own precision from its config instead, so this plugin adds no autocast
    and no input conversion (engines cast their own inputs, see :func:`~lightning_multids.engines.build_engine`).

    Args:
        precision: the Trainer's precision flag, e.g. ``"32-true"`` or ``"bf16-mixed"``.
    """

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Accept clipping the engine already does in ``step()``; anything else is an error.

        DeepSpeed clips by global norm inside ``engine.step()`` (``gradient_clipping`` in its config), after
        the gradients are reduced; clipping the local, unreduced or partitioned gradients here would be wrong.
        """
        if clip_val is None or clip_val <= 0:
            return
        assert isinstance(optimizer, EngineOptimizer)
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
        if algorithm == GradClipAlgorithmType.NORM and optimizer.engine.gradient_clipping() == clip_val:
            return
        raise ValueError(
            f"Clipping the gradients of engine {optimizer.name!r} by {algorithm.value} {clip_val} is not possible "
            f"here: DeepSpeed clips by norm in `step()`, and this engine clips at "
            f'{optimizer.engine.gradient_clipping()}. Set `"gradient_clipping": {clip_val}` in its DeepSpeed '
            "config (or `Trainer(gradient_clip_val=...)` for every engine) and remove the call."
        )
