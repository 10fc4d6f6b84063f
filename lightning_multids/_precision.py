"""Precision: each engine's own (from its DeepSpeed config), its input cast, and fp16 loss scales across engines.

The strategy's precision plugin keeps only the Trainer's flag; a loss that crosses fp16 engines at different
loss scales is scaled so that each engine sees its gradients at its own scale (:func:`loss_scaling`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_multids._optimizer import EngineOptimizer

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""The Trainer's mixed-precision flags and the dtype Lightning's ``MixedPrecision`` autocasts each to."""


class EnginePrecision(Precision):
    """Keeps the Trainer's ``precision`` flag for the engine configs; under mixed precision, autocast as DDP has.

    Each DeepSpeed engine runs its own precision from its config (engines cast their own inputs, see
    :func:`cast_inputs`). What runs outside the engines (a plain head fed by an engine, a loss with an fp32 weight)
    runs under ``torch.autocast`` (bf16 under ``bf16-mixed``, fp16 under ``16-mixed``) in the steps' forward, as
    Lightning's ``MixedPrecision`` runs it under ``DDPStrategy``; so do the 16-bit engines' submodules, whose weights
    are in that dtype already. An fp32 engine (an EMA
    engine, an engine whose config turns bf16 off) runs its forward with autocast off (:func:`autocast_off`).

    Args:
        precision: the Trainer's precision flag, e.g. ``"32-true"`` or ``"bf16-mixed"``.
        device: the device type autocast runs on, ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, precision: str = "32-true", device: str = "cpu") -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.device = device

    @override
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast under ``bf16-mixed`` and ``16-mixed`` (``cache_enabled=False``), as Lightning's ``MixedPrecision``.

        To bf16 under ``bf16-mixed``, to fp16 under ``16-mixed``: a plain fp32 submodule fed by an fp16 engine then
        runs as under ``DDPStrategy(precision="16-mixed")`` instead of failing on the dtypes.
        """
        dtype = AUTOCAST_DTYPES.get(str(self.precision))
        if dtype is None:
            yield
            return
        with torch.autocast(self.device, dtype=dtype, cache_enabled=False):
            yield

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
        if isinstance(optimizer, LightningOptimizer):  # from self.optimizers()
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, EngineOptimizer):
            raise TypeError(
                f"`clip_gradients` got {type(optimizer).__name__}, not an optimizer of this strategy's engines: pass "
                "one from `self.optimizers()`, which DeepSpeed steps and clips."
            )
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
        if algorithm != GradClipAlgorithmType.NORM:
            raise ValueError(
                f"Clipping the gradients of engine {optimizer.name!r} by {algorithm.value} is not available: DeepSpeed "
                "clips by global norm inside `step()`. Use `gradient_clip_algorithm='norm'`."
            )
        optimizer.clip_next_step(float(clip_val))


def engine_dtype(engine: DeepSpeedEngine) -> torch.dtype:
    """The dtype ``engine`` holds its module's weights in: bf16, fp16 or fp32."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def autocast_off(module: nn.Module, device_type: str) -> list[RemovableHandle]:
    """Run ``module``'s forward with ``device_type``'s autocast off where it is on; return the hooks' handles.

    For an fp32 engine's submodule inside a ``bf16-mixed`` step: its config chose fp32. Where autocast is off
    already (an fp32 run) the hooks change nothing. The hook after the forward runs also when the forward raises
    (``always_call``), so autocast is never left off.
    """
    contexts: list[torch.autocast | None] = []

    def enter(_: nn.Module, args: tuple) -> None:
        context = torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else None
        if context is not None:
            context.__enter__()
        contexts.append(context)

    def leave(_: nn.Module, args: tuple, output: Any) -> None:
        context = contexts.pop()
        if context is not None:
            context.__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


def cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook that casts floating-point tensors among a module's inputs to ``dtype``."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not kwargs and all(type(arg) is torch.Tensor for arg in args):  # the usual call: plain tensors only
            if all(arg.dtype == dtype or not arg.is_floating_point() for arg in args):
                return None  # nothing to cast: the inputs as they are
            return tuple(cast(arg) for arg in args), kwargs
        return apply_to_collection(args, torch.Tensor, cast), apply_to_collection(kwargs, torch.Tensor, cast)

    return hook


def loss_scaling(scales: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """How to scale one loss that reaches engines at loss ``scales``: the loss factor, and a gradient factor each.

    Each fp16 engine's optimizer divides its gradients by its own dynamic loss scale in ``step()``; bf16
    and fp32 engines divide by nothing (scale 1, :func:`~lightning_multids._compat.deepspeed.loss_scale`). The loss is
    multiplied by the smallest scale above 1, S (so no engine's backward runs at a larger scale than its own
    scaler allows), and each engine's gradients by ``its scale / S`` as they arrive (the router's gradient
    hook), so every engine sees its gradients at its own scale. Engines at S are left out of the factors.
    """
    fp16 = [scale for scale in scales.values() if scale != 1.0]
    common = min(fp16) if fp16 else 1.0
    return common, {name: scale / common for name, scale in scales.items() if scale != common}
