"""Losses whose reach differs between ranks, and a reentrant checkpoint met after a plain call: one step each.

Each step is written once for Lightning and for plain PyTorch: ``rank`` is the rank computing it (the
reference runs both ranks' losses in one process and backpropagates their mean, as DDP averages gradients).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from tests import patterns

CASES = ("uneven", "late_plain")


def uses_discriminator(rank: int, step: int) -> bool:
    """D (and G's last layer through it) is reached on one rank per step, and on none every third step."""
    return step % 3 != 2 and (step + rank) % 2 == 0


def steps_discriminator(step: int) -> bool:
    """Whether some rank's loss reaches D at ``step`` (the same on every rank): only then is D stepped."""
    return step % 3 != 2


def uneven_loss(G: nn.Module, D: nn.Module, batch: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """A data-dependent adversarial term: D reached on some ranks only, G's last layer on one or on all.

    Every rank calls both engines (a ZeRO-3 engine's forward gathers its parameters: a collective); only the
    terms added to the loss differ.
    """
    real, z = patterns.split(batch)
    hidden = G[1](G[0](z))
    fake = G[2](hidden)
    adversarial = (D(fake) - 0.5).pow(2).mean()
    loss = (hidden[:, :6] - real).pow(2).mean()
    if uses_discriminator(rank, step):
        loss = loss + adversarial
    elif not steps_discriminator(step):
        loss = loss + 0.1 * fake.pow(2).mean()  # G's last layer reached on every rank, D on none
    return loss


def late_plain_loss(G: nn.Module, D: nn.Module, batch: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """D inside a reentrant checkpoint, then plainly later: the plain call's gradients arrive first."""
    real, z = patterns.split(batch)
    checkpointed = torch.utils.checkpoint.checkpoint(D, G(z), use_reentrant=True)
    return (checkpointed - 0.5).pow(2).mean() + D(real).pow(2).mean()


LOSSES = {"uneven": uneven_loss, "late_plain": late_plain_loss}


def train_step(case: str, G: nn.Module, D: nn.Module, loss: torch.Tensor, opt_g: Any, opt_d: Any, step: int) -> None:
    """Step G always and D where some rank reached it, then clear both."""
    del G, D
    opt_g.step()
    if case != "uneven" or steps_discriminator(step):
        opt_d.step()
    opt_g.zero_grad()
    opt_d.zero_grad()


def reference(case: str, optimizer: str, steps: int, world_size: int = 2, global_batch: int = 8) -> dict:
    """Plain PyTorch on the global batch: each rank's loss on its shard, gradients averaged over the ranks."""
    G, D = patterns.make_modules()
    opt_g, opt_d = (
        patterns.make_optimizer(optimizer, G.parameters()),
        patterns.make_optimizer(optimizer, D.parameters()),
    )
    data = patterns.make_batches(steps, global_batch)
    for step in range(steps):
        batch = data[step * global_batch : (step + 1) * global_batch]
        losses = [LOSSES[case](G, D, batch[rank::world_size], rank, step) for rank in range(world_size)]
        loss = torch.stack(losses).sum() / world_size
        loss.backward()
        train_step(case, G, D, loss, opt_g, opt_d, step)
    return patterns.weights(G, D)
