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
    and no input conversion (engines cast their own inputs, see :func:`~lightning_multids.engines.attach`).

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
        """Route clipping to the optimizer's engine: its next ``step()`` clips the reduced gradients by norm.

        Clipping here, before ``step()``, would see local unreduced (ZeRO-0/1) or partitioned (ZeRO-2/3)
        gradients; DeepSpeed clips correctly inside ``step()``. Only norm clipping exists there.
        """
        if not clip_val or clip_val <= 0:
            return
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer from self.optimizers()
        assert isinstance(optimizer, EngineOptimizer)
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
        if algorithm != GradClipAlgorithmType.NORM:
            raise ValueError(
                f"Clipping the gradients of engine {optimizer.name!r} by {algorithm.value} is not available: DeepSpeed "
                "clips by global norm inside `step()`. Use `gradient_clip_algorithm='norm'`."
            )
        optimizer.clip_next_step(float(clip_val))
