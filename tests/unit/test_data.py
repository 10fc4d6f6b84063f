"""The one-shot training dataloader source: stale requests dropped, a resumed fit requests again."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_multids._compat.lightning import _Requested
from lightning_multids._data import per_process_batch_size, train_loaders


def loader(batch_size: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.zeros(8, 2), batch_size=batch_size)


def test_a_fit_gets_the_dataloaders_requested_at_setup_once() -> None:
    fresh = loader(4)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=None))
    trainer.fit_loop._data_source = _Requested(fresh, "train_dataloader")
    assert train_loaders(trainer) is fresh  # type: ignore[arg-type]
    source = trainer.fit_loop._data_source
    assert source.dataloader() is fresh and source.loaders is None


def test_dataloaders_a_failed_fit_left_unused_are_not_reused() -> None:
    """A fit that failed after setup requested them left them in the source; the next fit asks anew."""
    stale, fresh = loader(4), loader(2)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=_Requested(fresh, "train_dataloader", stale)))
    assert train_loaders(trainer) is fresh  # type: ignore[arg-type]


def test_a_resumed_fit_requests_the_dataloaders_again_after_the_restore() -> None:
    for ckpt_path, expected in ((None, "requested at setup"), ("last.ckpt", "source")):
        datamodule = SimpleNamespace(trainer=SimpleNamespace(ckpt_path=ckpt_path))
        source = _Requested(datamodule, "train_dataloader", "requested at setup")
        assert (source.dataloader() == "requested at setup") == (expected == "requested at setup")


def test_batch_size_of_one_or_several_dataloaders() -> None:
    assert per_process_batch_size(loader(4)) == 4
    assert per_process_batch_size({"real": loader(4), "noise": loader(2)}) == 4
    assert per_process_batch_size([loader(3), loader(2)]) == 3
