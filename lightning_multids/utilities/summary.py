"""A callback that ends a fit by printing where its results are and the commands that use them."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["RunSummary"]


class RunSummary(pl.Callback):
    """On rank 0, after ``fit``: the engines, TensorBoard logs, the checkpoint, and commands to export and view.

    ``Trainer(callbacks=[RunSummary()])`` in a script, or under ``trainer.callbacks`` in YAML
    (``class_path: lightning_multids.utilities.RunSummary``). A LightningModule can add lines of its own
    through a ``run_summary`` attribute (a dict of label to text), as the GAN example does for its samples.
    The commands printed run as shown from the current directory: ``lightning-multids`` and
    ``tensorboard`` are named bare when they are on ``PATH``, otherwise by their path in this environment.
    Where the module logs a spread beside the checkpoint callback's monitored metric, as ``<monitor>_std`` (the
    GAN example's ``val/kid_std``), the best checkpoint's score is printed with it: ``(12.3 ± 1.1)``.
    """

    def __init__(self) -> None:
        self.stages: dict[str, int] = {}
        self.spreads: dict[float, float] = {}
        """The spread logged beside each value of the monitored metric, by that value (the best is one of them)."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the spread logged beside the monitored metric (``<monitor>_std``), if the module logs one."""
        callback = trainer.checkpoint_callback
        if not isinstance(callback, ModelCheckpoint) or not callback.monitor:
            return
        value, spread = (trainer.callback_metrics.get(name) for name in (callback.monitor, spread_of(callback.monitor)))
        if value is not None and spread is not None:
            self.spreads[float(value)] = float(spread)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read each engine's ZeRO stage (the engines exist until teardown, which comes before ``on_fit_end``)."""
        engines = getattr(trainer.strategy, "engines", {})
        self.stages = {name: engine.zero_optimization_stage() for name, engine in engines.items()}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the summary on rank 0."""
        if trainer.is_global_zero:
            print("\n" + "\n".join(self.lines(trainer, pl_module)), flush=True)

    def lines(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
        """The summary's lines, each a label and its text."""
        entries = {"Engines (ZeRO stage)": str(self.stages)}
        if trainer.logger is not None and trainer.logger.log_dir:
            entries["TensorBoard logs"] = str(trainer.logger.log_dir)
        entries.update(getattr(pl_module, "run_summary", {}))
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint):
            entries.update(checkpoint_lines(callback, self.spreads, _latest_of_others(trainer, callback)))
        if trainer.logger is not None and trainer.logger.save_dir:
            entries["See the curves"] = f"{command('tensorboard')} --logdir {trainer.logger.save_dir}"
        width = max(len(label) for label in entries) + 2
        return [f"{label + ':':<{width}}{text}" for label, text in entries.items()]


def spread_of(monitor: str) -> str:
    """The name of the spread logged beside the metric ``monitor``: ``val/kid`` -> ``val/kid_std``."""
    return f"{monitor}_std"


def _latest_of_others(trainer: pl.Trainer, first: ModelCheckpoint) -> str:
    """The newest checkpoint of another ``ModelCheckpoint`` without a ``monitor`` (one that saves each epoch's end)."""
    others = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c is not first]
    return next((c.last_model_path or c.best_model_path for c in others if not c.monitor), "")


def checkpoint_lines(
    callback: ModelCheckpoint, spreads: dict[float, float] | None = None, latest: str = ""
) -> dict[str, str]:
    """The checkpoint to export, and the command that does: the best by the callback's ``monitor`` if it has one.

    With a ``monitor`` and ``save_last``, or another callback that keeps the newest (``latest``), the last
    checkpoint (what ``--ckpt_path last`` resumes) is named too. The best score is shown with its spread where
    ``spreads`` (by value of the monitored metric) has one.
    """
    best = callback.best_model_path if callback.monitor else ""
    last = callback.last_model_path or latest
    path = best or last or callback.best_model_path
    if not path:
        return {}
    checkpoint = shown(path)
    entries = {}
    if best and callback.best_model_score is not None:
        score = float(callback.best_model_score)
        spread = (spreads or {}).get(score)
        shown_score = f"{score:.4g}" if spread is None else f"{score:.4g} ± {spread:.2g}"
        entries[f"Best checkpoint ({callback.monitor})"] = f"{checkpoint} ({shown_score})"
        if last and last != best:
            entries["Last checkpoint"] = shown(last)
    else:
        entries["Checkpoint"] = checkpoint
    exported = Path(checkpoint).parent / "exported"
    entries["Export weights"] = f"{command('lightning-multids')} export {checkpoint} {exported}"
    return entries


def shown(path: str) -> str:
    """``path`` relative to the current directory when it lies inside it (Lightning resolves some paths)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def command(name: str) -> str:
    """``name`` if the shell finds it on ``PATH``, else its path beside this Python (``.venv/bin/NAME``)."""
    beside = Path(sys.executable).parent / name
    if shutil.which(name) is not None or not beside.exists():
        return name
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)
