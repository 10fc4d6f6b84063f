"""The README's snippet, filled in and runnable: a GAN whose generator and discriminator are two DeepSpeed engines.

Run it on 2 CPU processes (about half a minute; Lightning starts the second process)::

    python -m examples.minimal

``GAN`` is the README's class as printed there; this file adds what the snippet leaves to you (the two networks,
the data) and ends by printing the engines' stages and the last losses. scikit-learn's 8x8 digits are the real
images (:mod:`examples.digits`).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from examples.digits import IMAGE, digits_split
from lightning_multids import MultiDeepSpeedStrategy


class Generator(nn.Module):
    """Noise to an 8x8 image (64 values in [-1, 1])."""

    def __init__(self, latent_dim: int = 16) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.net = nn.Sequential(nn.Linear(latent_dim, 128), nn.LeakyReLU(0.2), nn.Linear(128, IMAGE), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)

    def sample(self, n: int, device: torch.device) -> torch.Tensor:
        return self(torch.randn(n, self.latent_dim, device=device))


class Discriminator(nn.Module):
    """An image to one logit: real or generated."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IMAGE, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


# The README's snippet from here (tests/unit/test_minimal_example.py checks that it is the same code).
# fmt: off
class GAN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.generator = Generator()          # any nn.Module attributes
        self.discriminator = Discriminator()

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()      # one per engine, in configure_optimizers order
        fake = self.generator.sample(real.size(0), self.device)   # methods and attributes still work

        # discriminator: called twice in one loss
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits)) \
            + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
        opt_d.zero_grad()
        self.manual_backward(d_loss)          # runs the discriminator engine's backward once
        opt_d.step()                          # steps only the discriminator engine

        # generator: the loss flows through the discriminator engine
        with self.toggled_optimizer(opt_g):   # optional; without it D's stray gradients are
            logits = self.discriminator(fake) # cleared by its next zero_grad(), as in PyTorch
            g_loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]


strategy = MultiDeepSpeedStrategy(
    stage=2,                                                  # default ZeRO stage of every engine
    config=None,                                              # default DeepSpeed config: dict or JSON path
    engine_configs={"discriminator": {"zero_optimization": {"stage": 3}}},  # per-engine overrides (dict or JSON path)
)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=10)
# fmt: on
# The README's snippet ends here, but for the data (`datamodule=...` there).


class Digits(pl.LightningDataModule):
    """The training digits as ``(image, label)`` batches of 8 per process (no validation: the snippet has none)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(digits_split()["train"], batch_size=8, shuffle=True, drop_last=True)


class Report(pl.Callback):
    """Prints each engine's ZeRO stage (they exist during fit) and the last losses, on rank 0."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stages = {name: engine.zero_optimization_stage() for name, engine in trainer.strategy.engines.items()}
        losses = {name: round(float(value), 3) for name, value in trainer.callback_metrics.items()}
        if trainer.is_global_zero:
            print(f"engines (ZeRO stage): {stages}\nlast losses: {losses}", flush=True)


def main() -> None:
    trainer.callbacks.append(Report())
    trainer.fit(GAN(), datamodule=Digits())


if __name__ == "__main__":
    main()
