"""A GAN on scikit-learn's 8x8 digits with a generator engine and a discriminator engine.

Run on 2 CPU processes (Lightning starts the second one)::

    python examples/gan.py

The generator trains under ZeRO-1 and the discriminator under ZeRO-2: one DeepSpeed engine each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_multids import MultiDeepSpeedStrategy

IMAGE = 8 * 8


class DigitsDataModule(pl.LightningDataModule):
    """The 1,797 digit images that ship with scikit-learn, scaled to [-1, 1], with their labels."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 8.0 - 1.0
        self.train_set = TensorDataset(images, torch.tensor(digits.target))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)


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

    def sample(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` generated images (n x 64) from fresh noise."""
        return self(torch.randn(n, self.latent_dim, device=device))


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
    """Two submodules, two optimizers: the strategy builds two engines and runs manual optimization."""

    def __init__(self, latent_dim: int = 16, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()

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

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        ]


def save_grid(images: torch.Tensor, path: Path, columns: int = 8, scale: int = 6) -> None:
    """Write ``images`` (n x 64, in [-1, 1]) as one PNG grid of 8x8 digits."""
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).to(torch.uint8).view(-1, 8, 8)
    rows = (len(pixels) + columns - 1) // columns
    grid = torch.zeros(rows * 9 + 1, columns * 9 + 1, dtype=torch.uint8)
    for i, image in enumerate(pixels):
        r, c = divmod(i, columns)
        grid[1 + r * 9 : 1 + r * 9 + 8, 1 + c * 9 : 1 + c * 9 + 8] = image
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid.numpy()).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST).save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default="outputs/gan")
    args = parser.parse_args()

    pl.seed_everything(0)
    strategy = MultiDeepSpeedStrategy(
        stage=2,
        engines={"generator": {"zero_optimization": {"stage": 1}}},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        default_root_dir=args.out,
        log_every_n_steps=5,
        enable_model_summary=False,
    )
    module = DigitsGAN()
    trainer.fit(module, datamodule=DigitsDataModule())

    samples = module.generator.sample(64, module.device)  # ZeRO-1: every rank holds the whole generator
    if trainer.global_rank == 0:
        png = Path(args.out) / "samples.png"
        save_grid(samples, png)
        logs = trainer.logger.log_dir if trainer.logger else args.out
        print(f"\nEngines: { {name: engine.zero_optimization_stage() for name, engine in strategy.engines.items()} }")
        print(f"Samples:      {png}")
        checkpoint = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else "-"
        print(f"Checkpoint:   {checkpoint}")
        print(f"Export:       lightning-multids export '{checkpoint}' {Path(args.out) / 'exported'}")
        print(f"Logs:         {logs}")
        print(f"Curves:       tensorboard --logdir {Path(logs).parent}")


if __name__ == "__main__":
    main()
