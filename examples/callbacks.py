"""A callback that ends a run by printing where its results are."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl


class RunSummary(pl.Callback):
    """On rank 0, after ``fit``: the engines, the checkpoint, TensorBoard logs, sample images, next commands."""

    def __init__(self) -> None:
        self.stages: dict[str, int] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the engines exist until the strategy's teardown, which comes before on_fit_end
        engines = getattr(trainer.strategy, "engines", {})
        self.stages = {name: engine.zero_optimization_stage() for name, engine in engines.items()}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        stages = self.stages
        checkpoint = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
        checkpoint = checkpoint or (trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else "")
        lines = [f"Engines (ZeRO stage): {stages}"]
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"TensorBoard logs:     {trainer.logger.log_dir}")
        samples = getattr(pl_module, "samples_png", None)
        if samples:
            lines.append(f"Samples:              {samples}")
        if checkpoint:
            lines.append(f"Checkpoint:           {checkpoint}")
            lines.append(
                f"Export weights:       lightning-multids export {checkpoint} {Path(checkpoint).parent / 'exported'}"
            )
        if trainer.logger is not None and trainer.logger.save_dir:
            lines.append(f"See the curves:       tensorboard --logdir {trainer.logger.save_dir}")
        print("\n" + "\n".join(lines), flush=True)
