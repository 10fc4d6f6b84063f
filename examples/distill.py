"""Knowledge distillation on scikit-learn's digits: a frozen ZeRO-3 teacher engine and a ZeRO-2 student engine.

Three runs, each a YAML in ``configs/``::

    lightning-multids fit --config configs/distill_teacher.yaml   # the teacher, trained on its own
    lightning-multids fit --config configs/distill_student.yaml   # the student alone (the baseline)
    lightning-multids fit --config configs/distill.yaml           # the student distilled from the teacher

The student sees only a fifth of the training labels in the last two runs; the teacher saw all of them.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from examples.digits import CLASSES, IMAGE
from lightning_multids.checkpoint import consolidated_state_dicts


class MLP(nn.Module):
    """A digit classifier: 64 pixels, ``hidden`` ReLU layers, 10 logits."""

    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        sizes = [IMAGE, *hidden]
        layers: list[nn.Module] = []
        for n_in, n_out in zip(sizes, sizes[1:], strict=False):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(sizes[-1], CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


class Classified(pl.LightningModule):
    """Validation and test accuracy (torchmetrics) of the submodule that :meth:`classify` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.val_accuracy = MulticlassAccuracy(CLASSES, average="micro")
        self.test_accuracy = MulticlassAccuracy(CLASSES, average="micro")

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.val_accuracy(self.classify(images), labels)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.test_accuracy(self.classify(images), labels)
        self.log("test/accuracy", self.test_accuracy)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.classify(batch[0]).argmax(-1)


class DigitsClassifier(Classified):
    """One network trained with cross-entropy: the teacher, or the student alone.

    One optimizer, so the strategy builds one engine and Lightning's automatic optimization runs.
    """

    def __init__(self, hidden: list[int], lr: float = 1e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = MLP(hidden)

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.net.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class Distillation(Classified):
    """A student trained on labels and on a frozen teacher's softened predictions (Hinton et al., 2015).

    ``loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross_entropy(student, labels)``,
    with both distributions softened by temperature ``T``. The teacher is a submodule with no optimizer:
    named in the strategy's ``engines``, it becomes a frozen engine (ZeRO-3: each rank holds a part).

    Args:
        teacher_checkpoint: a checkpoint directory of a :class:`DigitsClassifier` run (its ``net`` engine); None
            to build the module without the teacher's weights (``load_from_checkpoint`` of a student, the teacher
            not needed).
        teacher_hidden: the teacher's hidden layer sizes, as in that run.
        student_hidden: the student's hidden layer sizes.
    """

    def __init__(
        self,
        teacher_checkpoint: str | None,
        teacher_hidden: list[int],
        student_hidden: list[int],
        temperature: float = 4.0,
        alpha: float = 0.7,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
    ) -> None:
        super().__init__()
        if teacher_checkpoint is not None and not Path(teacher_checkpoint).exists():  # before the ranks start
            raise FileNotFoundError(
                f"The teacher checkpoint {teacher_checkpoint!r} does not exist. Train the teacher first: "
                "`lightning-multids fit --config configs/distill_teacher.yaml` writes it."
            )
        self.save_hyperparameters()
        self.teacher = MLP(teacher_hidden)
        self.student = MLP(student_hidden)
        self.teacher_accuracy = MulticlassAccuracy(CLASSES, average="micro")

    def setup(self, stage: str) -> None:
        """Load the teacher's trained weights, on every rank, before the strategy builds its engine."""
        if self.hparams.teacher_checkpoint is not None:
            self.teacher.load_state_dict(consolidated_state_dicts(Path(self.hparams.teacher_checkpoint))["net"])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        images, labels = batch
        self.teacher_accuracy(self.teacher(images), labels)
        self.log("val/teacher_accuracy", self.teacher_accuracy)

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        return self.student(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        t, alpha = self.hparams.temperature, self.hparams.alpha
        with torch.no_grad():
            teacher_logits = self.teacher(images)
        logits = self.student(images)
        soft = F.kl_div(
            F.log_softmax(logits / t, -1), F.log_softmax(teacher_logits / t, -1), reduction="batchmean", log_target=True
        )
        loss = alpha * t * t * soft + (1 - alpha) * F.cross_entropy(logits, labels)
        self.log_dict({"train/loss": loss, "train/distill": soft}, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
