"""GradCache: contrastive losses over batches far larger than fit in one forward, one gradient sync per step.

A contrastive loss couples every example of the batch (in-batch negatives), so the batch cannot simply
be split into accumulation steps. GradCache (Gao et al., 2021) splits it anyway, exactly:

1. encode every chunk without a graph (saving the RNG state before each chunk);
2. compute the loss on the cached representations, and its gradient with respect to them;
3. replay each chunk's forward with the same RNG state, with a graph, and backpropagate
   ``(representations * cached_gradient).sum()``, which gives that chunk's share of the parameter gradients.

Step 3 runs inside :meth:`MultiDeepSpeedStrategy.no_sync <lightning_multids.MultiDeepSpeedStrategy.no_sync>`,
so each engine reduces its gradients once per step however many chunks there are. Representations of
other ranks, for negatives, come from :func:`gather_with_grad`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_multids._joined import called_modules

__all__ = ["gather_with_grad", "grad_cache", "info_nce"]


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        ctx.rank, ctx.size = dist.get_rank(), tensor.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss depends on this rank's rows
        return grad[ctx.rank * ctx.size : (ctx.rank + 1) * ctx.size]


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenate ``tensor`` (same shape on every rank) from all ranks, in rank order; gradients flow back.

    The gradient that reaches this rank's rows is the sum over every rank's loss, so with gradients averaged
    over ranks (as DeepSpeed and DDP do) the parameters get the gradient of the mean of the ranks' losses.
    Without a process group it returns ``tensor``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    return _GatherWithGrad.apply(tensor)


class _RandomState:
    """The CPU and (where used) accelerator RNG state, to replay a chunk's dropout exactly."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            torch.cuda.set_rng_state(self.accelerator, self.device)


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[None]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def grad_cache(
    module: pl.LightningModule,
    encoders: Sequence[nn.Module],
    inputs: Sequence[Tensor],
    loss_fn: Callable[..., Tensor],
    chunk_size: int,
    defer_sync: bool = True,
) -> Tensor:
    """Backpropagate ``loss_fn(*(encoder(x) for x in inputs))`` chunk by chunk; return the loss, detached.

    Call it in ``training_step`` between ``opt.zero_grad()`` and ``opt.step()``. The gradients equal those of
    one ``manual_backward`` on the whole batch, while at most one chunk's activations are alive at a time.

    Args:
        module: the LightningModule (its ``manual_backward`` runs each chunk's backward).
        encoders: one submodule per input; the same submodule may encode several inputs (a shared encoder).
        inputs: the batch per encoder, split into chunks along the first dimension.
        loss_fn: the loss from the whole batch's representations, one argument per input; it may gather
            other ranks' representations with :func:`gather_with_grad`.
        chunk_size: the rows per forward.
        defer_sync: reduce the gradients once, after the last chunk (``False``: after every chunk, which
            costs more communication and gives the same result; for comparison).

    Under :class:`~lightning_multids.MultiDeepSpeedStrategy` the chunks' backwards run inside ``no_sync`` for
    the encoders' engines: one gradient reduction per engine per step.
    """
    if len(encoders) != len(inputs):
        raise ValueError(f"grad_cache got {len(encoders)} encoders for {len(inputs)} inputs: give one per input.")
    if chunk_size < 1:
        raise ValueError(f"grad_cache got chunk_size={chunk_size}: use a positive number of rows per chunk.")
    device = inputs[0].device
    chunks = [x.split(chunk_size) for x in inputs]
    states: list[list[_RandomState]] = []
    cached: list[Tensor] = []
    with torch.no_grad():
        for encoder, parts in zip(encoders, chunks, strict=True):
            states.append([])
            outputs = []
            for part in parts:
                states[-1].append(_RandomState(device))
                outputs.append(encoder(part))
            cached.append(torch.cat(outputs).detach().requires_grad_())
    with torch.enable_grad():
        loss = loss_fn(*cached)
    representation_grads = torch.autograd.grad(loss, cached)
    deferred = _no_sync_for(module, encoders) if defer_sync else contextlib.nullcontext()
    with deferred, _rng_preserved(device):
        for encoder, parts, part_states, grad in zip(encoders, chunks, states, representation_grads, strict=True):
            for part, state, part_grad in zip(parts, part_states, grad.split(chunk_size), strict=True):
                state.restore()
                module.manual_backward((encoder(part) * part_grad).sum())
    return loss.detach()


def _no_sync_for(module: pl.LightningModule, encoders: Sequence[nn.Module]) -> contextlib.AbstractContextManager:
    """The strategy's ``no_sync`` for the engines holding ``encoders``; nothing under another strategy."""
    strategy = module.trainer.strategy
    engines = getattr(strategy, "engines", None)
    if not engines or not hasattr(strategy, "no_sync"):
        return contextlib.nullcontext()
    held = {name: called_modules(engine.module) for name, engine in engines.items()}  # the parts of a joined one
    names = [name for name, parts in held.items() if any(part is encoder for part in parts for encoder in encoders)]
    missing = [type(e).__name__ for e in encoders if not any(part is e for parts in held.values() for part in parts)]
    if missing:
        raise ValueError(
            f"grad_cache: the encoders {missing} are not submodules with an engine. Pass the LightningModule's "
            "submodules themselves (e.g. `self.query_encoder`), each trained by an optimizer."
        )
    return strategy.no_sync(*dict.fromkeys(names))


def info_nce(queries: Tensor, docs: Tensor, temperature: float = 0.1) -> Tensor:
    """Symmetric InfoNCE (CLIP's loss) with every rank's examples as negatives; row ``i`` of both is a pair.

    Each rank scores its own queries against all ranks' docs and its own docs against all ranks' queries,
    so the mean of the ranks' losses is the loss of the whole global batch, as on one process.
    """
    queries, docs = nn.functional.normalize(queries, dim=-1), nn.functional.normalize(docs, dim=-1)
    all_queries, all_docs = gather_with_grad(queries), gather_with_grad(docs)
    rank = dist.get_rank() if all_queries.shape[0] != queries.shape[0] else 0
    labels = torch.arange(queries.shape[0], device=queries.device) + rank * queries.shape[0]
    query_loss = nn.functional.cross_entropy(queries @ all_docs.T / temperature, labels)
    doc_loss = nn.functional.cross_entropy(docs @ all_queries.T / temperature, labels)
    return (query_loss + doc_loss) / 2
