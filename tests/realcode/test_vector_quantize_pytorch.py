"""vector-quantize-pytorch==1.32.0: a VQ autoencoder beside a patch discriminator, two optimizers.

Follows the package's ``examples/autoencoder.py`` (github.com/lucidrains/vector-quantize-pytorch, the FashionMNIST
VQ experiment): the autoencoder is the package's ``Sequential`` of convolutions around
``VectorQuantize(dim, accept_image_fmap=True, codebook_size=..., rotation_trick=True, straight_through=False)`` with
the README's ``decay=0.8, commitment_weight=1.``, trained with AdamW on ``|out.clamp(-1, 1) - x|.mean() + alpha *
commit_loss``. The codebook is the README's default, updated by EMA inside the forward (its ``embed``,
``embed_avg`` and ``cluster_size`` buffers change in every training forward). Beside it, as a VQGAN trains one, a
small patch discriminator with its own AdamW and the hinge loss; the autoencoder's loss adds the generator's
``-D(out).mean()``, which reaches the discriminator's parameters too (cleared by its ``zero_grad()`` before its own
loss). The quantizer is a child of the autoencoder, inside its forward, as the example holds it. Images are
8x8 smooth patterns made with torch.

What it found (fixed): the codebook is built before the process group exists, so each rank updates its own
(``sync_codebook`` is off), and the buffers decide which rank's is used. Lightning's ``DDPStrategy`` in manual
optimization broadcasts rank 0's buffers before the first step only (its forward redirection turns
``require_backward_grad_sync`` off inside DDP's forward, so DDP's ``_post_forward`` turns ``require_forward_param_sync``
off, and no later forward broadcasts); the strategy broadcast them at every ``training_step``, and rank 1's codebook
differed from step 2 (weights off by 4e-3). It now broadcasts where DDPStrategy does, and every setup matches.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from vector_quantize_pytorch import Sequential, VectorQuantize

from tests.distributed.common import sharded_loader
from tests.realcode.harness import Case, Launched, assert_matches_ddp, setups

STEPS, PER_RANK, SIDE = 3, 4, 8
ALPHA, LR = 10.0, 3e-3  # the example's alpha; its lr x10, so 3 steps move the weights


def autoencoder() -> nn.Module:
    return Sequential(
        nn.Conv2d(1, 4, kernel_size=3, stride=1, padding=1),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.GELU(),
        nn.Conv2d(4, 8, kernel_size=3, stride=1, padding=1),
        nn.MaxPool2d(kernel_size=2, stride=2),
        VectorQuantize(
            dim=8,
            accept_image_fmap=True,
            codebook_size=16,
            decay=0.8,
            commitment_weight=1.0,
            rotation_trick=True,
            straight_through=False,
        ),
        nn.Upsample(scale_factor=2, mode="nearest"),
        nn.Conv2d(8, 4, kernel_size=3, stride=1, padding=1),
        nn.GELU(),
        nn.Upsample(scale_factor=2, mode="nearest"),
        nn.Conv2d(4, 1, kernel_size=3, stride=1, padding=1),
    )


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, kernel_size=4, stride=2, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(4, 1, kernel_size=3)
    )


def images() -> torch.Tensor:
    """Smooth 8x8 patterns in [-1, 1]: sums of two random plane waves."""
    generator = torch.Generator().manual_seed(1)
    grid = torch.stack(torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="ij")).float()
    waves = torch.randn(STEPS * PER_RANK * 2, 2, 2, generator=generator)
    phase = torch.einsum("nkc,chw->nkhw", waves, grid)
    return torch.sin(phase).mean(1, keepdim=True)


class VQGAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.autoencoder, self.discriminator = autoencoder(), discriminator()
        self.automatic_optimization = False

    def training_step(self, x: torch.Tensor, batch_idx: int) -> None:
        opt_ae, opt_d = self.optimizers()
        out, _, commit_loss = self.autoencoder(x)
        out = out.clamp(-1.0, 1.0)
        loss = (out - x).abs().mean() + ALPHA * commit_loss - self.discriminator(out).mean()
        opt_ae.zero_grad()
        self.manual_backward(loss)
        opt_ae.step()
        hinge = nn.functional.relu
        d_loss = hinge(1 - self.discriminator(x)).mean() + hinge(1 + self.discriminator(out.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW(m.parameters(), lr=LR) for m in (self.autoencoder, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, images(), batch_size=PER_RANK)


CASE = Case(
    build=VQGAN,
    mixed={"discriminator": 3},  # the autoencoder at ZeRO-2, its loss through a ZeRO-3 discriminator
    find_unused=True,  # the discriminator's backward leaves the autoencoder without a gradient (DDP's reducer)
)


@pytest.mark.parametrize("setup", setups(CASE))
def test_matches_ddp(setup: str, launched: Launched) -> None:
    assert_matches_ddp(launched, setup)
