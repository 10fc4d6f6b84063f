"""A GAN on scikit-learn's 8x8 digits: a generator engine and a discriminator engine.

Run it through the CLI on 2 CPU processes (Lightning starts the second one)::

    lightning-multids fit --config configs/gan.yaml

The generator trains under ZeRO-1 and the discriminator under ZeRO-2 (``configs/ds/``); ``generator_ema``, an
exponential moving average of the generator (the strategy's ``ema=``), is a frozen ZeRO-3 engine, and samples
are drawn from it. Both networks are told which digit to draw or judge (a conditional GAN): an unconditional one
of this size collapses onto a few digits. Each validation epoch logs the Kernel Inception Distance between
generated and held-out digits, measured in the feature space of a small digit classifier
(:mod:`examples.digits`), with its standard error (``val/kid`` and ``val/kid_std``; the best checkpoint is the
epoch of lowest KID), how varied the samples of each digit are against held-out digits (``val/diversity``),
the share of each digit among samples as that classifier labels them (``digits/0`` to ``digits/9``;
``val/rarest_digit`` the least), and a grid of samples (one column per digit).
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler
from torchmetrics.image.kid import poly_mmd
from torchmetrics.utilities.distributed import gather_all_tensors

from examples.digits import CLASSES, IMAGE, DigitsFeatures, digits_split, load_features


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.net = nn.Sequential(
            nn.Linear(latent_dim + CLASSES, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, IMAGE),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, F.one_hot(labels, CLASSES).to(z.dtype)], dim=1))

    def sample(
        self,
        labels: torch.Tensor,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One generated image (n x 64) of each digit in ``labels`` from fresh noise (from ``generator`` when given)."""
        z = torch.randn(len(labels), self.latent_dim, generator=generator)
        return self(z.to(device), labels.to(device))


class Discriminator(nn.Module):
    """Judges an image as a drawing of a given digit: real or generated (a projection discriminator).

    Its logit is ``w . h(x) + e(digit) . h(x)``: a real-or-generated score plus how well the image's features match
    the digit's embedding (Miyato and Koyama, 2018), so it judges image and digit together.
    """

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(IMAGE, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
        )
        self.score = nn.Linear(hidden, 1)
        self.digits = nn.Embedding(CLASSES, hidden)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The real-or-generated logit (n) of each image drawn as its digit in ``labels``."""
        features = self.body(x)
        return self.score(features).squeeze(1) + (self.digits(labels) * features).sum(1)

    def loss(self, x: torch.Tensor, labels: torch.Tensor, real: bool) -> torch.Tensor:
        """Binary cross-entropy of the logits against ``real``."""
        logit = self(x, labels)
        return F.binary_cross_entropy_with_logits(logit, torch.full_like(logit, float(real)))


class DigitsGAN(pl.LightningModule):
    """Two submodules, two optimizers: the strategy builds two engines and runs manual optimization.

    Args:
        latent_dim: the size of the generator's noise.
        lr: Adam's learning rate for both engines.
        grid_rows: how many samples of each digit the image grid logged each validation epoch shows.
        histogram_samples: how many samples the class histogram at the end of fit labels.
        kid_draws: how many sets of samples, each as large as the held-out split, KID is averaged over (2 or more:
            their spread gives its standard error).
    """

    def __init__(
        self,
        latent_dim: int = 16,
        lr: float = 2e-3,
        grid_rows: int = 6,
        histogram_samples: int = 2000,
        kid_draws: int = 64,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()
        self.generator_ema = copy.deepcopy(self.generator)  # an average of the generator when the strategy keeps one
        # A plain submodule (no optimizer, no engine): a digit classifier, whose features KID compares.
        self.classifier = load_features()
        self.kid_features: list[torch.Tensor] = []  # per validation batch: the held-out digits', then each draw's
        self.run_summary: dict[str, str] = {}  # extra lines for lightning_multids.utilities.RunSummary

    @property
    def sampler(self) -> Generator:
        """What samples come from: the generator's average when the strategy keeps one (``ema=``), else itself."""
        averaged = "generator_ema" in getattr(self.trainer.strategy, "averages", {})
        return self.generator_ema if averaged else self.generator

    def on_train_start(self) -> None:
        torch.manual_seed(1234 + self.global_rank)  # different noise on each rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, labels = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator.sample(labels, self.device)

        # Discriminator: called twice, on real and on (detached) generated images of the digits in `labels`.
        d_loss = self.discriminator.loss(real, labels, True) + self.discriminator.loss(fake.detach(), labels, False)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        # Generator: its loss flows through the discriminator, whose gradients stay off while toggled.
        with self.toggled_optimizer(opt_g):
            g_loss = self.discriminator.loss(fake, labels, True)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

        self.log_dict({"train/d_loss": d_loss, "train/g_loss": g_loss}, prog_bar=True, sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """The features of the held-out digits and of ``kid_draws`` as many samples, each asked for a random digit.

        The same noise and digits every epoch (per rank and batch): two epochs' KIDs differ by the generator, not by
        the draw. The digits asked for do not follow the held-out ones': samples asked for exactly their labels
        match their counts of each digit, which biases KID low, below 0 for a good generator.
        """
        real, _ = batch
        fixed = torch.Generator().manual_seed((self.global_rank << 20) + batch_idx)
        draws = self.hparams.kid_draws
        asked = torch.randint(CLASSES, (draws * len(real),), generator=fixed)
        samples = self.sampler.sample(asked, self.device, generator=fixed)
        features = torch.stack([self.classifier(real), *self.classifier(samples).chunk(draws)])
        self.kid_features.append(features.float())  # KID in fp32 whatever the precision

    def on_validation_epoch_end(self) -> None:
        kid, kid_std = self.kernel_inception_distance()
        shares = self.class_shares(self.hparams.histogram_samples // 4).to(self.device)  # synced: nccl needs the GPU
        metrics = {"val/kid": kid, "val/kid_std": kid_std, "val/rarest_digit": shares.min()}
        self.log_dict(metrics, prog_bar=True, sync_dist=True)
        self.log_dict({f"digits/{digit}": share for digit, share in enumerate(shares)}, sync_dist=True)
        self.log("val/diversity", self.diversity(), sync_dist=True)
        # The same noise every epoch, so the grids show one set of samples improving; a column per digit.
        fixed = torch.Generator().manual_seed(0)
        labels = torch.arange(CLASSES).repeat(self.hparams.grid_rows)
        grid = image_grid(self.sampler.sample(labels, self.device, generator=fixed), columns=CLASSES)
        if self.trainer.is_global_zero and isinstance(self.logger, TensorBoardLogger):
            self.logger.experiment.add_image("samples", grid, self.global_step, dataformats="HW")
            samples_png = Path(self.logger.log_dir) / "samples.png"
            save_png(grid, samples_png)
            self.run_summary["Samples"] = str(samples_png)

    def on_train_end(self) -> None:
        shares = self.class_shares(self.hparams.histogram_samples)
        histogram = "  ".join(f"{digit}: {share:.1%}" for digit, share in enumerate(shares.tolist()))
        self.run_summary["Digits drawn"] = f"{histogram} (of {self.hparams.histogram_samples}, by the classifier)"

    def kernel_inception_distance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """KID between the held-out digits and the samples, and its standard error; every rank gets the same.

        Each draw of samples (as many as the held-out digits) is compared with all of them by torchmetrics' unbiased
        estimate of KID (``poly_mmd``); the result is the mean over draws, and its standard error the draws' spread
        over the square root of their number: how far the mean would move with other samples.
        """
        local = torch.cat(self.kid_features, dim=1)  # 1 + draws, digits of this rank, 32
        self.kid_features.clear()
        features = torch.cat(gather_all_tensors(local), dim=1)  # every rank's digits (as torchmetrics' own metrics)
        real, draws = features[0], features[1:]
        kids = torch.stack([poly_mmd(real, draw) for draw in draws])
        return kids.mean(), kids.std() / len(kids) ** 0.5

    @torch.no_grad()
    def class_shares(self, n: int) -> torch.Tensor:
        """The share of each digit among ``n`` samples (n/10 asked of each), as the example's classifier labels them."""
        labels = torch.arange(CLASSES).repeat_interleave(n // CLASSES)
        fixed = torch.Generator().manual_seed(1)
        return digit_shares(self.classifier, self.sampler.sample(labels, self.device, generator=fixed))

    @torch.no_grad()
    def diversity(self, per_digit: int = 50) -> float:
        """How varied the samples of each digit are, against held-out digits: 1 is as varied, 0 all alike.

        For each digit, the mean distance between two samples in the classifier's feature space over the same for
        the held-out images of that digit; the mean over digits. The same noise every epoch, on every rank.
        """
        images, labels = (tensor.to(self.device) for tensor in digits_split()["val"].tensors)
        asked = torch.arange(CLASSES).repeat_interleave(per_digit).to(self.device)
        fixed = torch.Generator().manual_seed(2)
        samples = self.sampler.sample(asked, self.device, generator=fixed).float()
        ratios = [
            spread(self.classifier(samples[asked == digit])) / spread(self.classifier(images[labels == digit]))
            for digit in range(CLASSES)
        ]
        return float(torch.stack(ratios).mean())

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():  # manual optimization: the schedulers are stepped here
            scheduler.step()

    def configure_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LRScheduler]]:
        betas = (0.5, 0.999)
        optimizers = [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        ]
        # The learning rates decay to 0 over the run: a GAN's samples keep swinging at a constant rate.
        epochs = max(self.trainer.max_epochs or 1, 1)
        return optimizers, [CosineAnnealingLR(optimizer, T_max=epochs) for optimizer in optimizers]


def digit_shares(classifier: DigitsFeatures, images: torch.Tensor) -> torch.Tensor:
    """The share of each digit among ``images`` as ``classifier`` labels them (10 floats summing to 1)."""
    predicted = classifier.classify(images.float()).argmax(dim=1)
    return torch.bincount(predicted.cpu(), minlength=CLASSES).float() / len(images)


def spread(features: torch.Tensor) -> torch.Tensor:
    """The mean Euclidean distance between two different rows of ``features`` (n x d, n >= 2)."""
    distances = torch.cdist(features, features)
    return distances.sum() / (len(features) * (len(features) - 1))


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
