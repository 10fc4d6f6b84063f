"""Lightning's private names the strategy uses, each read from Lightning 2.6.6 (``lightning>=2.6.6,<2.7``).

Lightning's own strategies use these too; a subclass of ``DDPStrategy`` can do what DDP does only through them.
Every one is here, so that a Lightning release that moves one breaks one file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _configure_schedulers_manual_opt,
    _validate_multiple_optimizers_support,
    _validate_optimizers_attached,
    _validate_scheduler_api,
)
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource, _request_dataloader
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.optim import Optimizer

# ---- the module and the trainer ---------------------------------------------------------------------------


def trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None when it has none (``module.trainer`` raises then): ``module._trainer``."""
    return module._trainer


def stored_precision_plugin(strategy: pl.strategies.Strategy) -> Precision | None:
    """The precision plugin a strategy holds, None if none yet (``Strategy._precision_plugin``).

    Lightning's accelerator connector reads the same attribute to decide whether to hand the strategy the plugin
    for the Trainer's ``precision`` flag.
    """
    return strategy._precision_plugin


def store_precision_plugin(strategy: pl.strategies.Strategy, plugin: Precision | None) -> None:
    """Set the precision plugin a strategy holds (``Strategy._precision_plugin``); None leaves it to the connector."""
    strategy._precision_plugin = plugin


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the fit loop is between accumulation steps (``fit_loop.epoch_loop._should_accumulate()``)."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def process_group_backend(strategy: DDPStrategy) -> str | None:
    """The backend DDP chose for its process group (``DDPStrategy._process_group_backend``), after its setup."""
    return strategy._process_group_backend


def apply_layer_sync(strategy: DDPStrategy, model: nn.Module) -> nn.Module:
    """``model`` converted by the strategy's ``sync_batchnorm`` plugin (``DDPStrategy._layer_sync``), if it has one."""
    layer_sync = strategy._layer_sync
    return layer_sync.apply(model) if layer_sync else model


def sync_module_states(module: nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers, as DDP does outside fit (``overrides.distributed``)."""
    _sync_module_states(module)


# ---- configure_optimizers -----------------------------------------------------------------------------------


def call_configure_optimizers(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    """Call the module's ``configure_optimizers`` as the trainer does (``trainer.call._call_lightning_module_hook``)."""
    return call._call_lightning_module_hook(trainer, "configure_optimizers", pl_module=module)


def refuse_optimizer_idx(module: pl.LightningModule, optimizers: list[Optimizer]) -> None:
    """Lightning's own error for a ``training_step(..., optimizer_idx)`` written for Lightning 1.x.

    ``_validate_multiple_optimizers_support``, which the trainer calls where the strategy lets Lightning set up the
    optimizers; its first check is this one.
    """
    if is_param_in_hook_signature(module.training_step, "optimizer_idx", explicit=True):
        _validate_multiple_optimizers_support(optimizers, module)


def optimizers_and_schedulers(conf: Any) -> tuple[list[Optimizer], list[Any], str | None]:
    """What ``configure_optimizers`` returned, as Lightning reads it: optimizers, schedulers, monitor."""
    return _configure_optimizers(conf)


def scheduler_configs(
    schedulers: list[Any], monitor: str | None, module: pl.LightningModule, optimizers: list[Optimizer]
) -> list[LRSchedulerConfig]:
    """The schedulers as Lightning configures and validates them for the module's kind of optimization."""
    if module.automatic_optimization:
        configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    else:
        configs = _configure_schedulers_manual_opt(schedulers)
    _validate_optimizers_attached(optimizers, configs)
    _validate_scheduler_api(configs, module)
    return configs


# ---- the training dataloaders, requested once per fit ------------------------------------------------------


@dataclass
class _Requested(_DataLoaderSource):
    """A training dataloader source whose next request returns dataloaders already requested from it."""

    loaders: Any = None

    def dataloader(self) -> Any:
        loaders, self.loaders = self.loaders, None
        if loaders is None or _resumed(self.instance):
            return super().dataloader()
        return loaders


def _resumed(instance: Any) -> bool:
    """Whether this fit restored a checkpoint (Lightning restores after the strategy's setup)."""
    trainer = instance._trainer if isinstance(instance, pl.LightningModule) else getattr(instance, "trainer", None)
    return trainer is not None and trainer.ckpt_path is not None


def request_train_loaders(trainer: pl.Trainer) -> Any | None:
    """Request the fit's training dataloaders as the fit loop would, and hand them to its first request.

    ``_request_dataloader`` records their arguments for re-instantiation; the fit loop's ``_data_source`` is
    replaced by one that returns these dataloaders once. None where the fit has no training dataloader.
    """
    source = forget_requested(trainer)
    if not source.is_defined():
        return None
    loaders = _request_dataloader(source)
    trainer.fit_loop._data_source = _Requested(source.instance, source.name, loaders)
    return loaders


def forget_requested(trainer: pl.Trainer) -> _DataLoaderSource:
    """Put the fit loop's plain source back, dropping dataloaders a failed or ended fit did not use."""
    source = trainer.fit_loop._data_source
    if isinstance(source, _Requested):
        source = trainer.fit_loop._data_source = _DataLoaderSource(source.instance, source.name)
    return source


# ---- the model summary -----------------------------------------------------------------------------------

SUMMARY_METHOD = "_summary"
"""``ModelSummary._summary(trainer, pl_module)``, the callback's method that picks the summary class."""


def summary_model(summary: Summary) -> nn.Module:
    """The module a summary describes (``ModelSummary._model``)."""
    return summary._model


def summary_layers(summary: Summary) -> list[nn.Module]:
    """The submodules a summary has a row for, in order (``_layer_summary``'s ``LayerSummary._module``)."""
    return [layer._module for layer in summary._layer_summary.values()]


def summary_depth(callback: ModelSummary) -> int:
    """The ``max_depth`` the summary callback was made with (``ModelSummary._max_depth``)."""
    return int(callback._max_depth)


def replace_summary(callback: ModelSummary, summary: Callable[[pl.Trainer, pl.LightningModule], Summary]) -> None:
    """Make the callback summarize with ``summary`` (an instance attribute over :data:`SUMMARY_METHOD`)."""
    setattr(callback, SUMMARY_METHOD, summary)


def restore_summary(callback: ModelSummary) -> None:
    """Undo :func:`replace_summary`."""
    vars(callback).pop(SUMMARY_METHOD, None)
