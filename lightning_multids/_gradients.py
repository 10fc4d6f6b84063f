"""Gradients between a backward and ``step()``, read whole.

Keeping them local (``no_sync``) is a block, in :mod:`lightning_multids._blocks`.

Clearing and resetting an engine's gradients touch DeepSpeed's internals, so they live in
:mod:`lightning_multids._compat.deepspeed` (``clear_gradients``, ``abandon_backward``, ``abandon_step``).
"""

from __future__ import annotations

import torch
from deepspeed import DeepSpeedEngine

from lightning_multids._compat import deepspeed as ds_compat


def full_gradients(engine: DeepSpeedEngine, name: str, present: bool = True) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient, whole and averaged over the ranks, between a backward and ``step()``.

    What one process of plain PyTorch on the global batch holds in ``param.grad`` (before the optimizer's
    own loss-scale division, which is undone here for fp16). A collective call: every rank, same engines,
    same order. Keys are the parameter names within the engine's module. Stage 0/1 hold local gradients,
    all-reduced here; stage 2/3 hold reduced partitions, gathered with DeepSpeed's ``safe_get_full_grad``.
    With ``present`` False (no backward reached the engine on any rank since its last step or ``zero_grad``;
    the ranks agree on that after every backward) the gradients are zeros, with no collective.
    """
    params = {key: param for key, param in engine.module.named_parameters() if param.requires_grad}
    if not present:
        return {
            key: torch.zeros(ds_compat.full_shape(param), dtype=torch.float32, device=param.device)
            for key, param in params.items()
        }
    if engine.zero_optimization_partition_gradients():
        grads = ds_compat.gathered_gradients(engine, name, params)
    else:
        grads = {key: ds_compat.local_gradient(param) for key, param in params.items()}
        for grad in grads.values():
            torch.distributed.all_reduce(grad)
            grad /= torch.distributed.get_world_size()
    scale = ds_compat.loss_scale(engine)
    return {
        key: grad.detach().float().reshape(ds_compat.full_shape(params[key])) / scale for key, grad in grads.items()
    }
