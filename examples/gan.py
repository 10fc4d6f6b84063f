"""A GAN on scikit-learn's 8x8 digits: a generator engine and a discriminator engine.

Run it through the CLI on 2 CPU processes (Lightning starts the second one)::

    lightning-multids fit --config configs/gan.yaml

The generator trains under ZeRO-1 and the discriminator under ZeRO-2 (``configs/ds/``). Each validation
epoch logs the Kernel Inception Distance between generated and held-out digits, measured in the feature
space of a small digit classifier (:mod:`examples.digits`), and a grid of samples to TensorBoard.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from torch import nn
from torchmetrics.image.kid import KernelInceptionDistance

from examples.digits import IMAGE, load_features


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.net = nn.Sequential(
            nn.Linear(latent_dim, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, IMAGE),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)

    def sample(self, n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` generated images (n x 64) from fresh noise (from ``generator`` when given)."""
        return self(torch.randn(n, self.latent_dim, generator=generator).to(device))


class Discriminator(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IMAGE, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsGAN(pl.LightningModule):
    """Two submodules, two optimizers: the strategy builds two engines and runs manual optimization.

    Args:
        latent_dim: the size of the generator's noise.
        lr: Adam's learning rate for both engines.
        grid_size: how many samples the image grid logged each validation epoch shows.
    """

    def __init__(self, latent_dim: int = 16, lr: float = 1e-3, grid_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()
        # A plain submodule (no optimizer, no engine): KID in a digit classifier's feature space.
        self.kid = KernelInceptionDistance(feature=load_features(), subsets=20, subset_size=100)
        self.samples_png: Path | None = None

    def on_train_start(self) -> None:
        torch.manual_seed(1234 + self.global_rank)  # different noise on each rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator.sample(real.size(0), self.device)

        # Discriminator: called twice, on real and on (detached) generated images.
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        # Generator: its loss flows through the discriminator, whose gradients stay off while toggled.
        with self.toggled_optimizer(opt_g):
            logits = self.discriminator(fake)
            g_loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

        self.log_dict({"train/d_loss": d_loss, "train/g_loss": g_loss}, prog_bar=True, sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, _ = batch
        self.kid.update(real, real=True)
        self.kid.update(self.generator.sample(real.size(0), self.device), real=False)

    def on_validation_epoch_end(self) -> None:
        kid_mean, _ = self.kid.compute()  # gathers every rank's features
        self.kid.reset()
        self.log("val/kid", kid_mean, prog_bar=True)
        # The same noise every epoch, so the grids show one set of samples improving.
        fixed = torch.Generator().manual_seed(0)
        grid = image_grid(self.generator.sample(self.hparams.grid_size, self.device, generator=fixed))
        if self.trainer.is_global_zero and isinstance(self.logger, TensorBoardLogger):
            self.logger.experiment.add_image("samples", grid, self.global_step, dataformats="HW")
            self.samples_png = Path(self.logger.log_dir) / "samples.png"
            save_png(grid, self.samples_png)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        ]


def image_grid(images: torch.Tensor, columns: int = 8) -> torch.Tensor:
    """``images`` (n x 64, in [-1, 1]) as one uint8 grid (H x W) of 8x8 digits with 1-pixel borders."""
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).to(torch.uint8).view(-1, 8, 8)
    rows = (len(pixels) + columns - 1) // columns
    grid = torch.zeros(rows * 9 + 1, columns * 9 + 1, dtype=torch.uint8)
    for i, image in enumerate(pixels):
        r, c = divmod(i, columns)
        grid[1 + r * 9 : 1 + r * 9 + 8, 1 + c * 9 : 1 + c * 9 + 8] = image
    return grid


def save_png(grid: torch.Tensor, path: Path, scale: int = 6) -> None:
    """Write a uint8 grid from :func:`image_grid` as a PNG, each pixel ``scale`` x ``scale``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(grid.numpy())
    image.resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST).save(path)
