"""Gradients between a backward and ``step()``, read whole.

Keeping them local (``no_sync``) is a block, in :mod:`lightning_multids._blocks`.

Clearing and resetting an engine's gradients touch DeepSpeed's internals, so they live in
:mod:`lightning_multids._compat.deepspeed` (``clear_gradients``, ``abandon_backward``, ``abandon_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from deepspeed import DeepSpeedEngine

from lightning_multids._compat import deepspeed as ds_compat


def clipped(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """``grads`` as ``clip_grad_norm_(..., max_norm)`` leaves them: scaled to global 2-norm ``max_norm`` if above.

    What ``full_gradients`` returns after ``self.clip_gradients(opt, ...)``, which DeepSpeed applies only inside
    ``step()``: a hook that reads gradients before the step (``on_before_optimizer_step``) sees them clipped, as
    under ``DDPStrategy``. The same coefficient as torch's and DeepSpeed's: ``max_norm / (norm + 1e-6)``, at most 1.
    """
    total = torch.nn.utils.get_total_norm(list(grads.values()))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {key: grad * coefficient for key, grad in grads.items()}


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


def refuse_engine_clipping(owners: Mapping[int, str], stages: Mapping[str, int]) -> Callable[[str, list], None]:
    """The check :func:`~lightning_multids._compat.torch.guard_gradient_clipping` runs before torch's clipping.

    It refuses a parameter of a trainable engine: there ``param.grad`` holds this rank's gradient before the
    ranks' average (ZeRO-0/1; DeepSpeed reduces in ``step()``) or None (ZeRO-2/3), so torch would clip by each
    rank's own norm, or clip nothing, where DDP clips the averaged gradient. Other parameters pass.

    Args:
        owners: ``id(parameter) -> engine name`` for every trainable engine's parameter (alive during the fit).
        stages: each trainable engine's ZeRO stage.
    """

    def check(function: str, parameters: list) -> None:
        names = sorted({owners[id(p)] for p in parameters if id(p) in owners})
        if not names:
            return
        name = names[0]
        held = (
            "None (DeepSpeed keeps only this rank's reduced partition), so nothing would be clipped"
            if stages[name] >= 2
            else "this rank's own gradient before the ranks' average (DeepSpeed reduces it in `opt.step()`), so "
            "each rank would clip by its own norm"
        )
        how = "DeepSpeed clips only by norm: " if function == "clip_grad_value_" else ""
        raise ValueError(
            f"`torch.nn.utils.{function}` over the parameters of engine {name!r} (ZeRO-{stages[name]}): its "
            f"`param.grad` is {held}. {how}clip with `self.clip_gradients(opt, gradient_clip_val=...)` before "
            "`opt.step()` (manual optimization) or `Trainer(gradient_clip_val=...)`: the engine's step clips the "
            f"averaged gradients by their global norm. To read the gradients or their norm: "
            f"`self.trainer.strategy.full_gradients({name!r})`."
        )

    return check


_READERS_OF_THEIR_OWN = ("torch", "deepspeed", "lightning_multids")
"""Packages whose accesses to a guarded ``param.grad`` or ``param.data`` pass: torch, DeepSpeed, the strategy."""


def from_own_code(reader: str) -> bool:
    """Whether ``reader`` (a module's ``__name__``) is torch's, DeepSpeed's or the strategy's."""
    return reader.split(".", 1)[0] in _READERS_OF_THEIR_OWN


def refuse_gradient_read(name: str, stage: int) -> Callable[[torch.Tensor, str, str], None]:
    """The check a read or write of ``param.grad`` of engine ``name`` runs between a backward and ``step()``.

    There DDP holds the gradient averaged over the ranks; DeepSpeed holds this rank's own before the average
    (ZeRO-0/1, reduced in ``step()``) or None (ZeRO-2/3, a reduced partition elsewhere). An access from user code
    (a norm logged, Lightning's ``grad_norm``, a projection written back) is refused; one from torch (such as
    ``Module.zero_grad``), DeepSpeed or the strategy passes. ``stage`` is the engine's ZeRO stage.
    """
    held = (
        "None here (DeepSpeed keeps only this rank's reduced partition)"
        if stage >= 2
        else "this rank's own gradient here, before the ranks' average (DeepSpeed reduces it in `opt.step()`)"
    )

    def check(param: torch.Tensor, reader: str, verb: str) -> None:
        if from_own_code(reader):
            return
        raise RuntimeError(
            f"`param.grad` of a parameter of engine {name!r} (ZeRO-{stage}) was {verb} between the backward and "
            f"`opt.step()` (in {reader or 'unknown code'}): under DDP it holds the gradient averaged over the "
            f"ranks; it is {held}. Read the gradients whole and averaged with "
            f"`self.trainer.strategy.full_gradients({name!r})` (on every rank: a collective), and their norm from "
            "those (Lightning's `grad_norm` reads `param.grad`); clip with "
            "`self.clip_gradients(opt, gradient_clip_val=...)`; clear with `opt.zero_grad()`. A change to a gradient "
            "before the step (a projection) has no supported way: change the loss instead."
        )

    return check
