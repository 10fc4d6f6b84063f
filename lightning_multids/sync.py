"""Gradient state of an engine between backward and step: clearing it, per ZeRO optimizer.

Engines run with ``managed_gradient_accumulation: false`` (see :mod:`lightning_multids.config`):
a backward accumulates, ``engine.step()`` is the boundary. What a backward leaves behind depends
on the optimizer DeepSpeed chose:

* stage 0, fp32: ``param.grad`` (reduced in ``step()``);
* stage 0, bf16 (``BF16_Optimizer``): fp32 gradient accumulators next to ``param.grad``;
* stage 1/2 (``DeepSpeedZeroOptimizer``): ``param.grad``/``grad_accum`` and, at stage 2, gradients
  already reduce-scattered into this rank's partition (``all_grad_tensors``, ``averaged_gradients``);
* stage 3 (``DeepSpeedZeroOptimizer_Stage3``): reduced partitions that a backward overwrites when
  ``micro_step_id`` is 0 and adds to otherwise.

``zero_grad()`` of DeepSpeed's ZeRO-1/2 optimizer only clears ``param.grad``; gradients that a
backward already reduced into the partition survive it and would leak into the next step (the GAN
generator's backward puts gradients on the discriminator that the user then clears).
:func:`clear_gradients` resets all of it, to the state ``step()`` leaves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer
from deepspeed.utils import safe_get_full_grad
from torch.utils.hooks import RemovableHandle


def clear_gradients(engine: DeepSpeedEngine) -> None:
    """Clear every gradient ``engine`` holds for its next step: local, accumulated and reduced."""
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        _clear_zero_1_2(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        optimizer.zero_grad(set_to_none=True)  # also sets micro_step_id = 0: the next reduction overwrites
        # ...but a parameter first reduced later in the step (a later backward, or a later reentrant
        # checkpoint phase) is added to its partition, which must not hold the last step's gradient.
        optimizer.grad_partitions_flat_buffer.zero_()
    elif optimizer is not None:
        optimizer.zero_grad(set_to_none=True)  # torch optimizer, or BF16/FP16_Optimizer: lp and hp grads
    engine.zero_grad()  # param.grad of every module parameter


def abandon_backward(engine: DeepSpeedEngine) -> None:
    """Return ``engine`` to a clean state after an exception ended its backward early; no collective.

    The backward's prologue ran and its epilogue did not, so DeepSpeed's bookkeeping is half-way (read from
    DeepSpeed 0.19.8): the ZeRO backward depth stays raised; ZeRO-1/2 keep gradients in the reduction
    bucket and ``params_already_reduced`` flags, which make the next epilogue reduce stale gradients or
    assert; ZeRO-3 keeps parameters in its bucket. All of it is reset, and every gradient the engine holds
    for this step is dropped, since part of it may already be reduced and the rest not: reducing now would
    need every rank, and only this one may have failed. The next backward starts as after ``zero_grad()``.
    """
    for param in engine.module.parameters():
        param.grad = None  # ZeRO-3 reduces and drops them in the backward; its zero_grad() fails on CPU ones left
    optimizer = engine.optimizer
    if isinstance(optimizer, ZeROOptimizer):
        optimizer._backward_active_depth = 0
        optimizer.clear_backward_seen_flag()
    _reset_reduction(optimizer)
    clear_gradients(engine)


def abandon_step(engine: DeepSpeedEngine) -> None:
    """Return ``engine`` to a clean state after an exception ended ``engine.step()`` early; no collective.

    ``engine.step()`` marks itself as the accumulation boundary until it returns (DeepSpeed 0.19.8,
    unmanaged accumulation); left set, every later backward would reduce as if at the boundary. The
    reduction state is reset as after a backward; the caller then clears the gradients.
    """
    engine._running_engine_step = False
    _reset_reduction(engine.optimizer)


def _reset_reduction(optimizer: Any) -> None:
    """Empty the reduction buckets of a ZeRO optimizer and its per-parameter "already reduced" flags."""
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        for bucket in optimizer.ipg_buckets.values():
            bucket.clear()
        optimizer._release_ipg_buffers()  # as the epilogue ends: also the offset into the partition buffer
        optimizer.params_already_reduced[:] = [False] * len(optimizer.params_already_reduced)
        for grads in optimizer.previous_reduced_grads.values():
            grads.clear()
        optimizer.extra_large_param_to_reduce.clear()
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        for bucket in optimizer.ipg_buckets.values():
            bucket.clear_params()
        optimizer.params_already_reduced.update(dict.fromkeys(optimizer.params_already_reduced, False))


def _clear_zero_1_2(optimizer: DeepSpeedZeroOptimizer) -> None:
    optimizer._release_preflattened_grad_buffers()
    for index in range(len(optimizer.bit16_groups)):
        optimizer.averaged_gradients[index] = None
        optimizer.all_grad_tensors[index] = None
    optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
    optimizer.zero_grad(set_to_none=True)


def full_gradients(engine: DeepSpeedEngine, name: str) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient, whole and averaged over the ranks, between a backward and ``step()``.

    What one process of plain PyTorch on the global batch holds in ``param.grad`` (before the optimizer's
    own loss-scale division, which is undone here for fp16). A collective call: every rank, same engines,
    same order. Keys are the parameter names within the engine's module. Read from (DeepSpeed 0.19.8):

    * stage 0/1: the local gradient (``param.grad``, or ZeRO-1's ``grad_accum``), all-reduced here;
    * stage 2: this rank's reduced fragments, which DeepSpeed's ``safe_get_full_grad`` reads only at the
      accumulation boundary (``averaged_gradients``), so they are built for it from the accumulated ones;
    * stage 3: ``safe_get_full_grad``, which gathers the reduced partitions.
    """
    optimizer = engine.optimizer
    params = {name: param for name, param in engine.module.named_parameters() if param.requires_grad}
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        grads = {name: safe_get_full_grad(param) for name, param in params.items()}
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.partition_gradients:
        _refuse_unexposed_fragments(optimizer, name)
        with _reduced_fragments_exposed(optimizer):
            grads = {name: safe_get_full_grad(param) for name, param in params.items()}
    else:
        grads = {name: _local_gradient(param) for name, param in params.items()}
        for grad in grads.values():
            torch.distributed.all_reduce(grad)
            grad /= torch.distributed.get_world_size()
    scale = loss_scale(engine)
    return {
        name: grad.detach()
        .float()
        .reshape(params[name].ds_shape if hasattr(params[name], "ds_shape") else params[name].shape)
        / scale
        for name, grad in grads.items()
    }


def _local_gradient(param: torch.nn.Parameter) -> torch.Tensor:
    grad = param.grad if param.grad is not None else getattr(param, "grad_accum", None)
    if grad is None:
        grad = getattr(param, "_hp_grad", None)  # bf16 at stage 0: BF16_Optimizer accumulates in fp32 beside it
    return torch.zeros_like(param, dtype=torch.float32) if grad is None else grad.detach().float().clone()


def _refuse_unexposed_fragments(optimizer: DeepSpeedZeroOptimizer, name: str) -> None:
    """ZeRO-2 keeps no accumulated fragments to expose with an offloaded optimizer or an fp32 accumulator."""
    compact = any(optimizer._use_compact_grad_partition_buffer(i) for i in range(len(optimizer.bit16_groups)))
    if optimizer.cpu_offload or compact:
        setting = "`zero_optimization.offload_optimizer`" if optimizer.cpu_offload else "`data_types.grad_accum_dtype`"
        raise NotImplementedError(
            f"`full_gradients({name!r})` cannot read the ZeRO-2 engine {name!r} with {setting} set: DeepSpeed keeps "
            "its reduced gradients elsewhere until `step()`. Remove the setting from that engine's config, or use "
            "ZeRO-1 or ZeRO-3 for it."
        )


@contextmanager
def _reduced_fragments_exposed(optimizer: DeepSpeedZeroOptimizer) -> Iterator[None]:
    """Show ZeRO-2's accumulated reduced gradients where ``safe_get_full_grad`` reads them, during the body."""
    for index in range(len(optimizer.bit16_groups)):
        optimizer.averaged_gradients[index] = optimizer.get_flat_partition(
            optimizer.params_in_partition[index],
            optimizer.first_offset[index],
            optimizer.partition_size[index],
            dtype=optimizer.gradient_accumulation_dtype,
            device=get_accelerator().current_device_name(),
            param_group_idx=index,
            return_tensor_list=True,
        )
    try:
        yield
    finally:
        for index in range(len(optimizer.bit16_groups)):
            optimizer.averaged_gradients[index] = None


def loss_scale(engine: DeepSpeedEngine) -> float:
    """The factor ``engine``'s optimizer divides gradients by in ``step()``: its fp16 loss scale, else 1."""
    if not engine.fp16_enabled():
        return 1.0
    scale: Any = getattr(engine.optimizer, "loss_scale", None)  # ZeRO optimizers
    if scale is None:
        scale = getattr(engine.optimizer, "cur_scale", 1.0)  # FP16_Optimizer (stage 0)
    return float(scale)


def set_gradient_clipping(engine: DeepSpeedEngine, max_norm: float) -> None:
    """Make ``engine.step()`` clip the reduced gradients to global norm ``max_norm`` (0 turns clipping off).

    The engine reads ``gradient_clipping`` from its config at stage 0; ZeRO and bf16 optimizers copy it
    into ``clip_grad`` when built, so both are set.
    """
    engine._config.gradient_clipping = float(max_norm)
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = float(max_norm)


class NonFiniteGradients(FloatingPointError):
    """Raised in ``engine.step()`` when the reduced gradients hold a NaN or inf (:func:`skip_nonfinite_steps`)."""


def skip_nonfinite_steps(engine: DeepSpeedEngine) -> RemovableHandle | None:
    """Make ``engine.step()`` apply no update, on every rank alike, when its reduced gradients hold a NaN or inf.

    The check runs on the gradients after the reduction, where every rank sees the same verdict, so it
    costs no collective of its own. DeepSpeed makes it already for most optimizers, and skips the step
    (``engine.skipped_steps`` grows):

    * fp16 engines: the dynamic loss scaler;
    * bf16 at stage 0 (``BF16_Optimizer``) and every ZeRO-3 engine: a non-finite global gradient norm;
    * ZeRO-1/2: its overflow check (``bf16.check_grad_overflow``, on by default) or, in fp32, the global
      gradient norm (``zero_optimization.compute_grad_norm``, on by default).

    Where it does not, this makes sure something does. A ZeRO-1/2 config that turns DeepSpeed's check off
    (bf16 with ``check_grad_overflow: false``, fp32 with ``compute_grad_norm: false``) gets the overflow check
    turned back on. Stage 0 in fp32 steps the torch optimizer as it is: a step pre-hook on it raises
    :class:`NonFiniteGradients` before it updates anything (the reduced gradients are the same on every rank
    at stage 0, so every rank raises); its handle is returned, for teardown.
    """
    optimizer = engine.optimizer
    if engine.fp16_enabled() or isinstance(optimizer, BF16_Optimizer | DeepSpeedZeroOptimizer_Stage3):
        return None
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if not (optimizer.compute_grad_norm and optimizer.dtype != torch.bfloat16):
            optimizer.check_grad_overflow = True
    elif isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.register_step_pre_hook(_refuse_nonfinite)
    return None


def _refuse_nonfinite(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # One sum per gradient, no full-size temporary: a NaN or inf anywhere makes the total non-finite. (Finite
    # values whose sum overflows would too; no real gradient sums past 3e38.)
    sums = [p.grad.sum() for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if sums and not torch.isfinite(torch.stack(sums).sum()):
        raise NonFiniteGradients


def is_deferred(engine: DeepSpeedEngine) -> bool:
    """Whether ``engine`` is inside :func:`deferred_reduction` (its gradients stay local until the block ends)."""
    return bool(getattr(engine, "inside_no_sync_ctxt", False))


@contextmanager
def reduction_skipped(engine: DeepSpeedEngine) -> Iterator[None]:
    """Run the body with DeepSpeed's no_sync flag set, so that ``engine``'s backward epilogue reduces nothing."""
    engine.inside_no_sync_ctxt = True
    try:
        yield
    finally:
        engine.inside_no_sync_ctxt = False


@contextmanager
def deferred_reduction(engines: Mapping[str, DeepSpeedEngine]) -> Iterator[None]:
    """Keep the gradients of ``engines`` local during the body; reduce each engine once when it ends.

    Under this strategy (unmanaged accumulation, ``engine.step()`` is the boundary) stages 0 and 1
    reduce only in ``step()``, so several backwards already cost one reduction; stages 2 and 3 reduce
    (reduce-scatter) during every backward. Inside the block, ZeRO-2/3 engines instead accumulate full,
    unpartitioned gradients in ``param.grad`` (DeepSpeed's ``_coalesce_grad_reduction`` switch, which its
    own ``coalesce_grad_reduction()`` uses), and on exit every rank reduces them once, in the same order,
    into the partitions, where they add to whatever earlier backwards of this step reduced. The flag that
    DeepSpeed's ``no_sync()`` sets also makes ``engine.step()`` refuse to run inside the block.

    On an exception the gradients of the block are dropped instead: reducing on only the ranks that
    got here would leave the others waiting.
    """
    for engine in engines.values():
        engine.inside_no_sync_ctxt = True
        if engine.zero_optimization_partition_gradients():
            engine.optimizer._coalesce_grad_reduction = True
    try:
        yield
    except BaseException:
        for engine in engines.values():
            _stop_deferring(engine)
            clear_gradients(engine)
        raise
    for name in sorted(engines):  # the same collective order on every rank
        _stop_deferring(engines[name])
        _reduce_local_gradients(engines[name])


def _stop_deferring(engine: DeepSpeedEngine) -> None:
    engine.inside_no_sync_ctxt = False
    if engine.zero_optimization_partition_gradients():
        engine.optimizer._coalesce_grad_reduction = False


def _reduce_local_gradients(engine: DeepSpeedEngine) -> None:
    """Reduce-scatter the gradients a ZeRO-2/3 engine accumulated locally, with DeepSpeed's own flush.

    The accumulation boundary stays off (``engine.step()`` is the boundary here), so what is reduced
    adds to the partitions rather than replacing them.
    """
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        engine._flush_coalesced_reduction_zero3(engine.optimizer)
    elif engine.zero_optimization_partition_gradients():
        engine._flush_coalesced_reduction_zero12(engine.optimizer)
