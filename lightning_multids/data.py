"""The training dataloaders, requested once per fit: the engines' batch bookkeeping reads them at setup.

DeepSpeed insists on ``train_micro_batch_size_per_gpu`` in every engine config, so the strategy needs the
per-process batch size before the engines exist, while Lightning requests the training dataloaders only
later, when its fit loop starts. :func:`train_loaders` requests them at setup exactly as Lightning would
(inside ``_request_dataloader``, which records their arguments for re-instantiation) and hands the same
objects to the fit loop's first request, so ``train_dataloader()`` runs once per fit, as under DDP.
Reloads (``reload_dataloaders_every_n_epochs``) ask the source again, as Lightning does; teardown puts
the plain source back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource, _request_dataloader
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader


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


def train_loaders(trainer: pl.Trainer) -> Any | None:
    """The training dataloader(s) of this fit, requested once (see the module); None if there are none.

    When the fit resumes from a checkpoint, the fit loop requests them again after the restore, as under
    DDP: a ``train_dataloader`` may depend on restored state (the epoch, a datamodule's ``load_state_dict``),
    so ``train_dataloader()`` runs twice then.
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


def per_process_batch_size(loaders: Any) -> int | None:
    """The samples per process in one training batch: the batch size of the (first) dataloader; None if unknown.

    With several dataloaders (a list, a dict, a ``CombinedLoader``) each batch holds one batch of each; the
    first dataloader's size is taken, as Lightning's ``extract_batch_size`` takes the first tensor's size.
    """
    flat = loaders.flattened if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders).flattened
    for loader in flat:
        if isinstance(loader, DataLoader):
            size = getattr(loader.batch_sampler, "batch_size", None) or loader.batch_size
            return int(size) if size else None
    return None
