"""Progress as plain lines when the output is not a terminal: the lines, and the command's choice of them."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids.cli import MultiDeepSpeedCLI
from lightning_multids.utilities import LineProgress


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch).pow(2).mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(6, 2), batch_size=2)

    val_dataloader = train_dataloader


def fitted_lines(capsys: pytest.CaptureFixture[str], **trainer_args: object) -> list[str]:
    """The lines of a 2-epoch fit of :class:`Tiny` (3 batches each), one per batch and more."""
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[LineProgress(every_n_seconds=0)],
        num_sanity_val_steps=0,
        **trainer_args,  # type: ignore[arg-type]
    )
    trainer.fit(Tiny())
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]


def test_lines_name_the_epoch_the_batch_the_step_and_the_progress_bar_metrics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = fitted_lines(capsys)
    assert re.fullmatch(r"epoch 1/2  batch 1/3  step 1  loss [\d.e-]+", lines[0]), lines
    assert re.fullmatch(r"epoch 1/2  done  step 3  loss [\d.e-]+  val_loss [\d.e-]+", lines[3]), lines
    assert re.fullmatch(r"epoch 2/2  done  step 6  loss [\d.e-]+  val_loss [\d.e-]+", lines[-1]), lines
    assert len(lines) == 2 * (3 + 1)  # a line per batch (every 0 s), one at the epoch's end with its validation


def test_a_validation_within_the_epoch_has_a_line_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    lines = fitted_lines(capsys, val_check_interval=2)  # after the second of three batches
    assert re.fullmatch(r"epoch 1/2  validated  step 2  loss [\d.e-]+  val_loss [\d.e-]+", lines[2]), lines
    assert re.fullmatch(r"epoch 1/2  batch 3/3  step 3  .*", lines[3]), lines
    assert re.fullmatch(r"epoch 1/2  done  step 3  .*", lines[4]), lines
    assert len(lines) == 2 * (3 + 2)


def test_the_command_prints_lines_in_place_of_the_bar_when_its_output_is_not_a_terminal() -> None:
    args = ["--model=tests.unit.test_progress.Tiny", "--data=lightning.pytorch.demos.boring_classes.BoringDataModule"]
    args += ["--trainer.accelerator=cpu", "--trainer.logger=false", "--seed_everything=false"]
    cli = MultiDeepSpeedCLI([*args, "--trainer.strategy=auto"], run=False)  # pytest's output is not a terminal
    assert type(cli.trainer.progress_bar_callback) is LineProgress
