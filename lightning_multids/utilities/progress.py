"""Progress as plain lines, for runs whose output is not a terminal (a log file, a pipe, a batch job).

Lightning's progress bar redraws one line with carriage returns; written to a file or a pipe, which Python
buffers, it shows nothing for minutes and then a wall of redraws. :class:`LineProgress` prints a whole line
instead, on rank 0, flushed: the epoch, the step, the progress bar's metrics, every ``every_n_seconds``, at the
end of each epoch (with the figures of a validation that ended it) and after a validation within an epoch.
``lightning-multids`` uses it in place of the bar when its output is not a terminal; in a script,
``Trainer(callbacks=[LineProgress()])``.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

__all__ = ["LineProgress"]


class LineProgress(ProgressBar):
    """Lightning's progress bar as plain lines: one every ``every_n_seconds`` of training, and at epoch ends."""

    def __init__(self, every_n_seconds: float = 30.0) -> None:
        super().__init__()
        self.every_n_seconds = every_n_seconds
        self._enabled = True
        self._last = 0.0
        self._validated = False  # a validation during fit whose line is not printed yet

    def disable(self) -> None:
        """Print nothing (Lightning calls it on every rank but 0, and around its tuners)."""
        self._enabled = False

    def enable(self) -> None:
        """Print again."""
        self._enabled = True

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the clock of the epoch's lines."""
        self._last = time.monotonic()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The line of a validation within the epoch, before the next batch trains (its figures are still shown)."""
        if self._validated:
            self._validated = False
            self._line(trainer, pl_module, "validated")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A line when ``every_n_seconds`` have passed since the last one."""
        if time.monotonic() - self._last >= self.every_n_seconds:
            self._line(trainer, pl_module, f"batch {batch_idx + 1}/{_total(self.total_train_batches)}")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A line at the end of each training epoch: with the figures of a validation that ended it, one line."""
        self._validated = False
        self._line(trainer, pl_module, "done")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a validation during fit (the sanity check has none): its line is the epoch's, or the next batch's."""
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._validated = True

    def _line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, where: str) -> None:
        self._last = time.monotonic()
        if not self._enabled:
            return
        epochs = "" if trainer.max_epochs is None or trainer.max_epochs < 0 else f"/{trainer.max_epochs}"
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown = "  ".join(f"{key} {_format(value)}" for key, value in metrics.items())
        self.print(f"epoch {trainer.current_epoch + 1}{epochs}  {where}  step {trainer.global_step}  {shown}".rstrip())

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print a whole line, flushed, so that a file or a pipe gets it at once."""
        print(*args, **kwargs, flush=True)


def _total(total: int | float) -> str:
    return "?" if total == float("inf") else str(int(total))


def _format(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
