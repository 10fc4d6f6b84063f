"""What rank code builds the same way: a quiet 2-process CPU Trainer, a sharded loader, a small regression."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_multids  # noqa: F401 (imports DeepSpeed, before the freeze below)

# Every runner imports this module after torch, Lightning and DeepSpeed: freezing what those imports allocated
# keeps it out of every later collection. DeepSpeed runs a full `gc.collect()` for each ZeRO-3 engine it builds
# (`defragment`), and a runner builds dozens; over the import-time heap each took about half a second here.
# Objects the runner creates are collected as before. Only in a rank's process (harness.run_ranks sets LOCAL_RANK):
# pytest's own process imports this module too (test modules hold their rank code) and is left as it was.
if "LOCAL_RANK" in os.environ:
    gc.freeze()

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def cpu_trainer(strategy: pl.strategies.Strategy, **kwargs: Any) -> pl.Trainer:
    """A Trainer on 2 CPU processes with ``strategy``, no logger, progress bar or summary; ``kwargs`` win.

    With ``TEST_NUM_NODES=2`` in the environment (see ``harness.run_ranks(nodes=2)``) the 2 processes are
    2 nodes of 1 process each. The GPU suite runs the same rank code as one process on one GPU:
    ``TEST_ACCELERATOR=gpu`` and ``WORLD_SIZE=1`` (see ``harness.on_ranks(world_size=1)``).
    """
    nodes = int(os.environ.get("TEST_NUM_NODES", "1"))
    options: dict[str, Any] = {
        "accelerator": os.environ.get("TEST_ACCELERATOR", "cpu"),
        "devices": world_size() // nodes,
        "num_nodes": nodes,
        "max_epochs": 1,
        **QUIET,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


_WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "2"))  # read at import: Lightning deletes it when a fit ends


def world_size() -> int:
    """The number of processes the harness started (2 unless the GPU suite asks for 1)."""
    return _WORLD_SIZE


def sharded_loader(module: pl.LightningModule, data: torch.Tensor, batch_size: int = 4) -> torch.utils.data.DataLoader:
    """This rank's share of ``data`` in order (rank r gets rows r, r + 2, ...), so a test knows the global batch.

    ``batch_size`` is the per-rank batch on 2 ranks: on 1 rank it doubles, so the global batch is the same.
    """
    batch_size = batch_size * 2 // world_size()
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=module.trainer.world_size, rank=module.global_rank, shuffle=False
    )
    return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler)


def finish() -> None:
    """End a runner whose work is done: wait for every rank, shut the process group down, and exit at once.

    The exit skips the interpreter's finalization: there, tensors still held by gloo's worker threads can be
    freed after Python is gone, which aborts the process ("terminate called without an active exception", seen
    once in CI on torch 2.11 after every result was written; pytorch/pytorch#179291 describes the race). A rank
    that failed raised before it got here, so its exit code still says so.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Record(pl.Callback):
    """Record ``read(strategy)`` in ``self.value`` at the hook a subclass names."""

    def __init__(self, read: Callable[[Any], Any]) -> None:
        self.read = read
        self.value: Any = None

    def _record(self, trainer: pl.Trainer) -> None:
        self.value = self.read(trainer.strategy)


class AtTrainStart(_Record):
    """Record ``read(strategy)`` when training starts (after setup and any resume, before a step) in ``self.value``."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer)


class AtFitEnd(_Record):
    """Record ``read(strategy)`` when training ends, before teardown stops the engines, in ``self.value``."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer)


def fit_for_weights(
    strategy: pl.strategies.Strategy, module: pl.LightningModule, ckpt_path: str | None = None, **options: Any
) -> tuple[pl.Trainer, dict[str, torch.Tensor]]:
    """Fit ``module`` (its own sharded loader, no checkpointing); the Trainer, and the weights
    ``strategy.consolidated_state_dict()`` gave when training ended, before teardown."""
    at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
    options = {"use_distributed_sampler": False, "enable_checkpointing": False, **options}
    trainer = cpu_trainer(strategy, callbacks=[at_end, *options.pop("callbacks", [])], **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, at_end.value


# ---- a small regression, for tests of one engine against plain PyTorch on the global batch ------------------------


def regression_model(seed: int = 0) -> torch.nn.Module:
    """A 4-8-1 MLP with tanh, its weights from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def regression_data(steps: int, per_rank: int) -> torch.Tensor:
    """``steps`` global batches of 2 x ``per_rank`` rows: 4 inputs and a target each."""
    return torch.randn(steps * per_rank * 2, 5, generator=torch.Generator().manual_seed(1))


def regression_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The mean squared error of ``model`` on ``batch``, in fp32 (a bf16 engine's output is cast)."""
    return torch.nn.functional.mse_loss(model(batch[:, :4]).squeeze(1).float(), batch[:, 4])


def global_batch(data: torch.Tensor, step: int, per_rank: int) -> torch.Tensor:
    """What the 2 ranks of :func:`sharded_loader` see together at ``step``: plain PyTorch's batch."""
    return torch.cat([data[rank::2][step * per_rank : (step + 1) * per_rank] for rank in range(2)])
