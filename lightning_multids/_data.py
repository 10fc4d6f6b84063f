"""The training dataloaders, requested once per fit: the engines' batch bookkeeping reads them at setup.

DeepSpeed insists on ``train_micro_batch_size_per_gpu`` in every engine config, so the strategy needs the
per-process batch size before the engines exist, while Lightning requests the training dataloaders only
later, when its fit loop starts. :func:`train_loaders` requests them at setup exactly as Lightning would
(:func:`~lightning_multids._compat.lightning.request_train_loaders`, which records their arguments for
re-instantiation) and hands the same objects to the fit loop's first request, so ``train_dataloader()`` runs
once per fit, as under DDP.
Reloads (``reload_dataloaders_every_n_epochs``) ask the source again, as Lightning does; teardown puts
the plain source back.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader

from lightning_multids._compat.lightning import request_train_loaders


def train_loaders(trainer: pl.Trainer) -> Any | None:
    """The training dataloader(s) of this fit, requested once (see the module); None if there are none.

    When the fit resumes from a checkpoint, the fit loop requests them again after the restore, as under
    DDP: a ``train_dataloader`` may depend on restored state (the epoch, a datamodule's ``load_state_dict``),
    so ``train_dataloader()`` runs twice then.
    """
    return request_train_loaders(trainer)


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
