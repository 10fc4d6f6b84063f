"""scikit-learn's 8x8 digits for every example: one fixed train/val/test split, and a small feature network.

The feature network (:class:`DigitsFeatures`) is a digit classifier trained once on the training split;
its penultimate layer is the feature space in which the GAN's KID is measured, as Inception features
are for natural images. Its weights ship next to this file; ``python -m examples.digits`` retrains them.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IMAGE = 8 * 8
CLASSES = 10
FEATURES_FILE = Path(__file__).with_name("digits_features.pt")


def digits_split(seed: int = 0, val: float = 0.15, test: float = 0.15) -> dict[str, TensorDataset]:
    """The 1,797 digits scaled to [-1, 1], split the same way on every call and every rank."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 8.0 - 1.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_val, n_test = int(len(order) * val), int(len(order) * test)
    parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {name: TensorDataset(images[index], labels[index]) for name, index in parts.items()}


class DigitsDataModule(pl.LightningDataModule):
    """Digits as ``(image, label)`` batches: images flat (64 values in [-1, 1]), a fixed 70/15/15 split.

    Args:
        batch_size: the batch size per process.
        eval_batch_size: the batch size per process for validation, test and predict.
        train_fraction: train on only the first part of the training split (e.g. to show distillation
            helping a student that sees few labels); validation and test always use their whole split.
    """

    def __init__(self, batch_size: int = 64, eval_batch_size: int = 128, train_fraction: float = 1.0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.train_fraction = train_fraction

    def setup(self, stage: str) -> None:
        self.splits = digits_split()
        train = self.splits["train"]
        keep = max(self.batch_size, int(len(train) * self.train_fraction))
        self.splits["train"] = TensorDataset(*(tensor[:keep] for tensor in train.tensors))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


class DigitsFeatures(nn.Module):
    """A small digit classifier whose 32-dimensional penultimate layer embeds images for KID.

    ``forward`` returns the features; ``classify`` the class logits. Loaded frozen by :func:`load_features`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IMAGE, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images.float())

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self(images))


def load_features() -> DigitsFeatures:
    """The trained feature network, frozen and in eval mode."""
    network = DigitsFeatures()
    network.load_state_dict(torch.load(FEATURES_FILE, weights_only=True))
    network.requires_grad_(False)
    return network.eval()


def train_features(epochs: int = 60, seed: int = 0) -> tuple[DigitsFeatures, float]:
    """Train :class:`DigitsFeatures` on the training split; return it and its test accuracy."""
    torch.manual_seed(seed)
    splits = digits_split()
    network = DigitsFeatures()
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-3, weight_decay=1e-4)
    loader = DataLoader(splits["train"], batch_size=64, shuffle=True)
    for _ in range(epochs):
        for images, labels in loader:
            loss = nn.functional.cross_entropy(network.classify(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    images, labels = splits["test"].tensors
    with torch.no_grad():
        accuracy = (network.classify(images).argmax(-1) == labels).float().mean().item()
    return network, accuracy


if __name__ == "__main__":
    trained, test_accuracy = train_features()
    torch.save(trained.state_dict(), FEATURES_FILE)
    print(f"wrote {FEATURES_FILE} (test accuracy {test_accuracy:.3f})")
