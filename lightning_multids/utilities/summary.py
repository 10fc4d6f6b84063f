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
    """

    def __init__(self) -> None:
        self.stages: dict[str, int] = {}

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
            entries.update(checkpoint_lines(callback))
        if trainer.logger is not None and trainer.logger.save_dir:
            entries["See the curves"] = f"{command('tensorboard')} --logdir {trainer.logger.save_dir}"
        width = max(len(label) for label in entries) + 2
        return [f"{label + ':':<{width}}{text}" for label, text in entries.items()]


def checkpoint_lines(callback: ModelCheckpoint) -> dict[str, str]:
    """The checkpoint to export, and the command that does: the best by the callback's ``monitor`` if it has one.

    With a ``monitor`` and ``save_last``, the last checkpoint (what ``--ckpt_path last`` resumes) is named too.
    """
    best = callback.best_model_path if callback.monitor else ""
    last = callback.last_model_path
    path = best or last or callback.best_model_path
    if not path:
        return {}
    checkpoint = shown(path)
    entries = {}
    if best and callback.best_model_score is not None:
        entries[f"Best checkpoint ({callback.monitor})"] = f"{checkpoint} ({float(callback.best_model_score):.4g})"
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
