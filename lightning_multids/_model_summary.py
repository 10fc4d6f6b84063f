"""Lightning's model summary, counting a ZeRO-3 engine's partitioned parameters whole.

A ZeRO-3 parameter holds an empty tensor between uses, so Lightning's summary would show a ZeRO-3 engine
with 0 parameters. Lightning's ``ModelSummary`` callback (and ``RichModelSummary``) switch to its
``DeepSpeedSummary``, which counts ``ds_numel`` and adds a "Params per Device" column, only for Lightning's
own ``DeepSpeedStrategy`` at ZeRO-3, where every parameter is partitioned. Here ZeRO-3 engines sit beside
whole submodules, so :class:`PartitionedSummary` counts each parameter either way, and
:func:`count_partitioned` makes the trainer's summary callbacks use it for the duration of a fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import lightning.pytorch as pl
from deepspeed import DeepSpeedEngine
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import DeepSpeedSummary
from torch import nn
from typing_extensions import override

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.lightning import (
    replace_summary,
    restore_summary,
    summary_depth,
    summary_layers,
    summary_model,
)
from lightning_multids._lifecycle import whole_numel


class PartitionedSummary(DeepSpeedSummary):
    """Lightning's ``DeepSpeedSummary`` where some parameters are ZeRO-3 partitions and others are whole.

    "Params" counts every parameter whole; "Params per Device" counts a ZeRO-3 parameter's partition and
    a whole parameter whole.
    """

    @property
    @override
    def param_nums(self) -> list[int]:
        return [whole_numel(layer.parameters()) for layer in summary_layers(self)]

    @property
    @override
    def parameters_per_layer(self) -> list[int]:
        return [_per_device(layer.parameters()) for layer in summary_layers(self)]

    @property
    @override
    def total_parameters(self) -> int:
        return whole_numel(summary_model(self).parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return whole_numel(p for p in summary_model(self).parameters() if p.requires_grad)


def _per_device(parameters: Iterable[nn.Parameter]) -> int:
    return sum(ds_compat.numel_on_rank(param) for param in parameters)


def count_partitioned(trainer: pl.Trainer, engines: Mapping[str, DeepSpeedEngine]) -> Callable[[], None]:
    """Make the trainer's model-summary callbacks use :class:`PartitionedSummary` when an engine is at ZeRO-3.

    Returns:
        A function that puts the callbacks back as they were (the strategy calls it at teardown).
    """
    if not any(engine.zero_optimization_stage() == 3 for engine in engines.values()):
        return lambda: None
    callbacks = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]  # type: ignore[attr-defined]
    for callback in callbacks:
        replace_summary(callback, _deepspeed_summary(callback))

    def undo() -> None:
        for callback in callbacks:
            restore_summary(callback)

    return undo


def _deepspeed_summary(callback: ModelSummary) -> Callable[[pl.Trainer, pl.LightningModule], PartitionedSummary]:
    def summary(trainer: pl.Trainer, pl_module: pl.LightningModule) -> PartitionedSummary:
        return PartitionedSummary(pl_module, max_depth=summary_depth(callback))

    return summary
