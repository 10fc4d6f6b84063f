"""Contrastive dual encoder on scikit-learn's digits with GradCache: a big batch, small chunks, one sync per step.

Run it through the CLI on 2 CPU processes (Lightning starts the second one)::

    lightning-multids fit --config configs/contrastive.yaml

Two "modalities" of each digit: the image (64 pixels, with noise added as augmentation) and its
projection profile (the 8 row sums and 8 column sums of the clean image, as a sensor might read it). An
image encoder (ZeRO-2) and a profile encoder (ZeRO-3), one engine each, learn a shared embedding in which
an image lies closest to its own profile. The loss is symmetric InfoNCE over every rank's examples, the
gradients come from :func:`~lightning_multids.utilities.gradcache.grad_cache` in chunks far smaller than the batch,
and each engine reduces its gradients once per step. Validation logs recall@1 (torchmetrics): how often an
image's nearest profile, among the validation batch's, is its own.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.retrieval import RetrievalRecall

from examples.digits import IMAGE
from lightning_multids.utilities.gradcache import grad_cache, info_nce

PROFILE = 16


def profile(images: torch.Tensor) -> torch.Tensor:
    """The row sums and column sums of flat 8x8 images (n x 64): n x 16, scaled to about [-1, 1]."""
    grid = images.view(-1, 8, 8)
    return torch.cat([grid.sum(dim=2), grid.sum(dim=1)], dim=1) / 8.0


class Encoder(nn.Module):
    """An MLP into the shared, L2-normalised embedding space (with dropout, which GradCache replays exactly)."""

    def __init__(self, inputs: int, embedding: int = 32, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(inputs, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, embedding)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


class DigitsDualEncoder(pl.LightningModule):
    """Image and profile encoders trained with InfoNCE through GradCache; two engines, manual optimization.

    Args:
        chunk_size: rows per forward/backward; the batch (the data module's ``batch_size``) can be far larger.
        temperature: InfoNCE's temperature.
        noise: the standard deviation of the Gaussian noise added to images (in [-1, 1] units).
        lr: AdamW's learning rate for both encoders.
        defer_sync: reduce gradients once per step (``False``: after every chunk; the same result with more
            communication, for ``benchmarks/gradcache.py``).
    """

    def __init__(
        self,
        chunk_size: int = 32,
        temperature: float = 0.1,
        noise: float = 0.3,
        lr: float = 1e-3,
        defer_sync: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.image_encoder = Encoder(IMAGE)
        self.profile_encoder = Encoder(PROFILE)
        self.val_recall = RetrievalRecall(top_k=1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, _ = batch
        views = images + self.hparams.noise * torch.randn_like(images)
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        loss = grad_cache(
            self,
            [self.image_encoder, self.profile_encoder],
            [views, profile(images)],
            lambda q, d: info_nce(q, d, self.hparams.temperature),
            chunk_size=self.hparams.chunk_size,
            defer_sync=self.hparams.defer_sync,
        )
        for opt in optimizers:
            opt.step()
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_start(self) -> None:
        self.queries_seen = 0

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, _ = batch
        scores = self.image_encoder(images) @ self.profile_encoder(profile(images)).T
        n = len(images)
        # A distinct id per query image across batches and ranks, repeated for each of its n candidates.
        ids = (self.queries_seen + torch.arange(n, device=self.device)) * self.trainer.world_size + self.global_rank
        self.queries_seen += n
        targets = torch.eye(n, dtype=torch.bool, device=self.device)
        self.val_recall(scores.flatten(), targets.flatten(), ids.repeat_interleave(n))
        self.log("val/recall@1", self.val_recall, prog_bar=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.AdamW(self.image_encoder.parameters(), lr=self.hparams.lr),
            torch.optim.AdamW(self.profile_encoder.parameters(), lr=self.hparams.lr),
        ]
