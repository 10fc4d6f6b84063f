"""pytorch-metric-learning==2.9.0: an embedding net beside a loss with trainable class centres, each its own optimizer.

Follows the package's ``examples/notebooks/SubCenterArcFaceMNIST.ipynb`` (github.com/KevinMusgrave/
pytorch-metric-learning): the MNIST ``Net`` of convolutions, dropout and a linear embedding (Adam, lr 0.01), the
package's ``losses.SubCenterArcFaceLoss(num_classes, embedding_size)`` whose centres ``W`` are trained by an
optimizer of their own (``loss_optimizer = Adam(loss_func.parameters(), ...)``), and the notebook's loop: both
``zero_grad()``, ``loss = loss_func(model(data), labels)``, backward, ``optimizer.step()``, ``loss_optimizer.step()``.
On 2 ranks the loss is wrapped as ``docs/distributed.md`` says for DistributedDataParallel:
``utils.distributed.DistributedLossWrapper(loss_func)``, which all-gathers every rank's embeddings and labels inside
its forward and scores the global batch (``efficient=False``, its default). In Lightning: manual optimization, two
optimizers in ``configure_optimizers``.

At tiny widths: the Net's 32/64 channels are 4/8 on 8x8 one-channel images, its 128-dimensional embedding 16, four
classes (the notebook: MNIST, ten); the loss's lr (1e-4) is raised to 1e-2 so 3 steps move the centres. Images and
labels are made with torch. Setups: each network at ZeRO 0/2/3, and mixed: the Net at ZeRO-3, the loss's centres at
ZeRO-0.

What it found (fixed): every forward of the package's ArcFace-family losses runs ``cast_types``, which
sets ``self.W.data = c_f.to_device(self.W.data, device=..., dtype=...)``: the same tensor when the device and dtype
already agree, inside the loss's own forward, where ZeRO-3 has gathered ``W``. The strategy's guard refused every
``param.data = ...`` outside a ``gathered`` block, so the first step raised ``RuntimeError: `param.data` of a parameter
of engine 'loss_func' (ZeRO-3) was set outside its forward (in pytorch_metric_learning.losses.arcface_loss)``: a
refusal of code that does nothing to the weight, and its message says "outside its forward" where the set is inside
it. The Net at ZeRO-3 beside the loss at ZeRO-0 (mixed) matches bit for bit.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses
from pytorch_metric_learning.utils import distributed as pml_dist
from torch import nn

from tests.distributed.common import sharded_loader
from tests.realcode.harness import Case, Launched, assert_matches_ddp, setups

STEPS, PER_RANK, SIDE, CLASSES, EMBEDDING = 3, 4, 8, 4, 16


class Net(nn.Module):
    """The notebook's MNIST ``Net`` (from PyTorch's MNIST example) at tiny widths."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(8 * ((SIDE - 4) // 2) ** 2, EMBEDDING)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        return self.fc1(x)


class SubCenterArcFace(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = Net()
        loss_func = losses.SubCenterArcFaceLoss(num_classes=CLASSES, embedding_size=EMBEDDING)
        self.loss_func = pml_dist.DistributedLossWrapper(loss_func)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        data, labels = batch
        optimizer, loss_optimizer = self.optimizers()
        optimizer.zero_grad()
        loss_optimizer.zero_grad()
        embeddings = self.model(data)
        loss = self.loss_func(embeddings, labels)
        self.manual_backward(loss)
        optimizer.step()
        loss_optimizer.step()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.model.parameters(), lr=0.01),
            torch.optim.Adam(self.loss_func.parameters(), lr=1e-2),
        ]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(1)
        rows = STEPS * PER_RANK * 2
        labels = torch.randint(CLASSES, (rows,), generator=generator)
        prototypes = torch.randn(CLASSES, 1, SIDE, SIDE, generator=generator)
        images = prototypes[labels] + 0.5 * torch.randn(rows, 1, SIDE, SIDE, generator=generator)
        return sharded_loader(self, torch.utils.data.TensorDataset(images, labels), batch_size=PER_RANK)  # type: ignore[arg-type]


CASE = Case(
    build=SubCenterArcFace,
    mixed={"model": 3, "loss_func": 0},
)


@pytest.mark.parametrize("setup", setups(CASE))
def test_matches_ddp(setup: str, launched: Launched) -> None:
    assert_matches_ddp(launched, setup)
