"""Every use of DeepSpeed's private API in lightning_multids, and nowhere else; read from DeepSpeed 0.19.8.

"Private" here means an underscore name, or an attribute DeepSpeed sets on its engine, optimizers or
parameters without documenting it (``averaged_gradients``, ``micro_step_id``, ``ds_shape``...). A patch
release can change any of them, and most would then fail as silently wrong gradients, not as errors.
So each use is one small function here, named for what it does for the strategy, with a line on what it
touches; the rest of the package calls those names and DeepSpeed's public API (``deepspeed.initialize``,
``engine.step()``, ``engine.allreduce_gradients()``, ``deepspeed.zero.Init``, ``GatheredParameters``,
``is_zero_param``, ``safe_get_full_grad``, checkpoints). At setup, :func:`check_deepspeed` refuses a
DeepSpeed outside :data:`SUPPORTED_DEEPSPEED` or one whose classes lack a method used here, and
:func:`check_engine` refuses a built engine that lacks an attribute used here.

Engines run with ``managed_gradient_accumulation: false`` (see :mod:`lightning_multids._config`): a
backward only accumulates and ``engine.step()`` is the accumulation boundary. What a backward leaves
behind depends on the optimizer DeepSpeed chose:

* stage 0, fp32: ``param.grad`` (reduced in ``step()``); stage 0, bf16 (``FP16_Optimizer`` over bf16 weights,
  DeepSpeed 0.19): ``param.grad`` in bf16; stage 0, fp16 (``FP16_Optimizer``): ``param.grad`` at the loss scale;
  stage 1, bf16 with ``data_types.grad_accum_dtype: fp32`` (``BF16_Optimizer``): fp32 accumulators beside it;
* stage 1/2 (``DeepSpeedZeroOptimizer``): ``param.grad``/``grad_accum`` and, at stage 2, gradients
  already reduce-scattered into this rank's partition (``all_grad_tensors``, ``averaged_gradients``);
* stage 3 (``DeepSpeedZeroOptimizer_Stage3``): reduced partitions that a backward overwrites when
  ``micro_step_id`` is 0 and adds to otherwise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dis
import importlib
import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import clip_grad_norm_
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload, ensure_zero_ordered_dict
from deepspeed.runtime.zero.partition_parameters import Init as zero_init_class
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.utils import is_zero_param
from deepspeed.utils import groups as ds_groups
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_set_full_fp32_param
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch._utils import _unflatten_dense_tensors
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_multids._compat import torch as torch_compat

SUPPORTED_DEEPSPEED = ">=0.19.8,<0.20"
"""The DeepSpeed releases this module was read from and tested with."""

_INSTALL = f"pip install 'deepspeed{SUPPORTED_DEEPSPEED}'"

# What this module calls on DeepSpeed's classes (checked at setup) and reads or sets on its objects (checked
# on every engine built). Keep these in step with the functions below.
_CLASS_METHODS: dict[type, tuple[str, ...]] = {
    DeepSpeedEngine: (
        "_backward_prologue",
        "_broadcast_model",
        "clip_fp32_gradients",
        "_backward_epilogue",
        "_flush_coalesced_reduction_zero12",
        "_flush_coalesced_reduction_zero3",
        "buffered_allreduce_fallback",
    ),
    ZeROOptimizer: ("clear_backward_seen_flag", "_backward_active_depth"),
    zero_init_class: ("_zero_init_param",),
    DeepSpeedZeroOptimizer: (
        "_release_ipg_buffers",
        "_release_preflattened_grad_buffers",
        "_wait_for_offload_copies",
        "_use_compact_grad_partition_buffer",
        "get_flat_partition",
        "reduce_gradients",
        "average_tensor",
        "setup_buckets",
    ),
    DeepSpeedZeroOptimizer_Stage3: (
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
        "_fp32_state_allgather",
        "_get_fp32_opt_state_partition",
    ),
    DeepSpeedZeRoOffload: (
        "_register_deepspeed_module",
        "release_backward_leftovers",
        "pre_sub_module_backward_function",
    ),
}
_ENGINE_ATTRIBUTES = (
    "_running_engine_backward_lock",
    "_running_engine_backward_count",
    "_running_engine_backward",
    "_running_engine_step",
    "inside_no_sync_ctxt",
    "_config",
    "basic_optimizer",
    "module_forward_pre_hook",
    "module_forward_post_hook",
)
_OPTIMIZER_ATTRIBUTES: dict[type, tuple[str, ...]] = {
    DeepSpeedZeroOptimizer: (
        "ipg_buckets",
        "params_already_reduced",
        "previous_reduced_grads",
        "extra_large_param_to_reduce",
        "averaged_gradients",
        "all_grad_tensors",
        "micro_step_id",
        "bit16_groups",
        "params_in_partition",
        "first_offset",
        "partition_size",
        "gradient_accumulation_dtype",
        "partition_gradients",
        "cpu_offload",
        "single_partition_of_fp32_groups",
        "parallel_partitioned_bit16_groups",
        "real_dp_process_group",
        "compute_grad_norm",
        "check_grad_overflow",
        "dtype",
        "clip_grad",
        "_coalesce_grad_reduction",
    ),
    DeepSpeedZeroOptimizer_Stage3: (
        "ipg_buckets",
        "params_already_reduced",
        "grad_partitions_flat_buffer",
        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
        "offload_optimizer",
        "fp32_partitioned_groups_flat",
        "reduce_and_partition_stream",
        "clip_grad",
        "_coalesce_grad_reduction",
    ),
    BF16_Optimizer: ("clip_grad", "bf16_partitioned_groups", "fp32_groups_flat_partition", "real_dp_process_group"),
}


_OPTIMIZER_ATTRIBUTES[FP16_Optimizer] = ("optimizer", "fp16_groups_flat", "fp32_groups_flat")
_OPTIMIZER_ATTRIBUTES[FP16_UnfusedOptimizer] = ("optimizer", "fp16_groups", "fp32_groups")


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is outside the supported range, or lacks something this package uses."""


# ---- at setup ---------------------------------------------------------------------------------------------


def check_deepspeed(version: str | None = None) -> None:
    """Raise :class:`UnsupportedDeepSpeed` unless DeepSpeed is in the supported range and has every method used here.

    Args:
        version: the DeepSpeed version to check; the installed one by default.
    """
    version = version or deepspeed.__version__
    if Version(Version(version).base_version) not in SpecifierSet(SUPPORTED_DEEPSPEED):  # local builds count
        raise UnsupportedDeepSpeed(
            f"MultiDeepSpeedStrategy supports DeepSpeed {SUPPORTED_DEEPSPEED}; this is DeepSpeed {version}. It drives "
            f"DeepSpeed's backward and gradient state directly, which other releases may change. Run `{_INSTALL}`."
        )
    for owner, names in _CLASS_METHODS.items():
        for name in names:
            if not hasattr(owner, name):
                _refuse_missing(f"{owner.__name__}.{name}")
    for name in ("_WORLD_GROUP", "_release_process_group_references"):
        if not hasattr(ds_groups, name):
            _refuse_missing(f"deepspeed.utils.groups.{name}")


def check_engine(name: str, engine: DeepSpeedEngine) -> None:
    """Raise :class:`UnsupportedDeepSpeed` if the engine ``name`` or its optimizer lacks an attribute used here."""
    for attribute in _ENGINE_ATTRIBUTES:
        if not hasattr(engine, attribute):
            _refuse_missing(f"DeepSpeedEngine.{attribute}", engine=name)
    for owner, attributes in _OPTIMIZER_ATTRIBUTES.items():
        if isinstance(engine.optimizer, owner):
            for attribute in attributes:
                if not hasattr(engine.optimizer, attribute):
                    _refuse_missing(f"{owner.__name__}.{attribute}", engine=name)


def _refuse_missing(what: str, engine: str | None = None) -> None:
    where = f" (engine {engine!r})" if engine else ""
    raise UnsupportedDeepSpeed(
        f"MultiDeepSpeedStrategy uses DeepSpeed's `{what}`{where}, which DeepSpeed {deepspeed.__version__} does not "
        f"have. It supports DeepSpeed {SUPPORTED_DEEPSPEED}: run `{_INSTALL}`."
    )


def forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached process groups when they belong to a ``torch.distributed`` world since destroyed.

    DeepSpeed caches its groups (``groups._WORLD_GROUP``, the data-parallel and expert groups, its device mesh) and
    releases them in its own ``deepspeed.comm.destroy_process_group``, not in torch's. After
    ``torch.distributed.destroy_process_group()`` (a notebook or a sweep between fits, Lightning's test fixtures)
    the next engine would use a destroyed group; torch no longer knows it (``get_process_group_ranks`` has no entry).
    """
    world = ds_groups._WORLD_GROUP
    if world is None:
        return
    try:
        torch.distributed.get_process_group_ranks(world)
    except KeyError:  # not a group of the running world
        ds_groups._release_process_group_references(group=None)


@contextmanager
def comm_without_inference_op() -> Iterator[None]:
    """Start DeepSpeed's comm layer without JIT-building its CPU shared-memory op (``comm.torch.build_shm_op``).

    DeepSpeed 0.19.8's ``TorchBackend`` compiles ``deepspeed_shm_comm`` with torch's extension builder whenever its
    comm layer starts on a CPU accelerator: 30-70 s on a new environment's first run. Only
    ``inference_all_reduce`` (AutoTP inference) uses it, and falls back to ``torch.distributed.all_reduce`` without
    it; training, all the strategy runs, never calls it. On a GPU the builder does not exist and nothing changes.
    """
    # by name: the attribute `deepspeed.comm.torch` is the torch package, which deepspeed.comm imports
    ds_comm_torch: Any = importlib.import_module("deepspeed.comm.torch")
    build = getattr(ds_comm_torch, "build_shm_op", None)
    if build is None:  # a DeepSpeed without it: nothing to leave out
        yield
        return
    ds_comm_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm_torch.build_shm_op = build


@contextmanager
def scalar_parameters_broadcast() -> Iterator[None]:
    """Let DeepSpeed broadcast 0-dim parameters at engine build and in ``zero.Init``.

    DeepSpeed 0.19.8 broadcasts each parameter as ``p.data.view(torch.uint8)`` (``DeepSpeedEngine._broadcast_model``,
    ``zero.Init._zero_init_param``), which torch refuses for a 0-dim tensor (``self.dim() cannot be 0 to view Float
    as Byte``): a learned temperature (CLIP's ``logit_scale``) or SAC's ``log_alpha`` stopped every engine build.
    Here each 0-dim parameter's data is a 1-element view of the same storage while it is broadcast, and 0-dim again
    after it; ZeRO-3 records the shape it gathers to (``ds_shape``) as 0-dim. The rest of DeepSpeed flattens
    parameters, which 0-dim ones allow.
    """
    broadcast, init_param = DeepSpeedEngine._broadcast_model, zero_init_class._zero_init_param

    def broadcast_model(engine: DeepSpeedEngine) -> None:
        scalars = [param for param in engine.module.parameters() if param.dim() == 0]
        for param in scalars:
            param.data = param.data.view(1)
        try:
            broadcast(engine)
        finally:
            for param in scalars:
                param.data = param.data.view(())

    def zero_init_param(init: Any, param: torch.nn.Parameter) -> None:
        if param.dim() != 0:
            init_param(init, param)
            return
        param.data = param.data.view(1)
        init_param(init, param)
        param.ds_shape = torch.Size(())  # type: ignore[attr-defined]  # DeepSpeed's, set by _zero_init_param
        if is_gathered(param):  # kept whole (persistent): 0-dim again
            param.data = param.data.view(())

    DeepSpeedEngine._broadcast_model, zero_init_class._zero_init_param = broadcast_model, zero_init_param
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model, zero_init_class._zero_init_param = broadcast, init_param


@contextmanager
def gathered_parameters(params: list[torch.nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
    """``deepspeed.zero.GatheredParameters(params, modifier_rank)``, where 0-dim parameters are broadcast too.

    Its end broadcasts ``modifier_rank``'s weights as ``p.data.view(torch.uint8)``, which a 0-dim tensor refuses:
    each 0-dim parameter's data is a 1-element view of the same storage while it ends, and 0-dim again where
    ZeRO-3 keeps it whole after.
    """
    scalars = [param for param in params if getattr(param, "ds_shape", None) == torch.Size(())]
    try:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=bool(params)):
            try:
                yield
            finally:
                for param in scalars:
                    if param.data.dim() == 0:
                        param.data = param.data.view(1)
    finally:
        for param in scalars:
            if param.data.numel() == 1:
                param.data = param.data.view(())


def scalar_safe_clipping(engine: DeepSpeedEngine) -> None:
    """Let a ZeRO-0 engine in fp32 clip the gradients of 0-dim parameters (``engine.clip_fp32_gradients``).

    DeepSpeed 0.19.8's ``clip_grad_norm_`` multiplies each gradient in place by a 1-element tensor, which a 0-dim
    gradient refuses (``output with shape [] doesn't match the broadcast shape [1]``): a 0-dim parameter is given
    to it as a 1-element parameter whose gradient is a view of the 0-dim one's, so the product lands in it.
    """
    params = list(engine.module.parameters())
    if not any(param.dim() == 0 for param in params):
        return

    def clip_fp32_gradients() -> None:
        vectors = [_as_vector(param) for param in params]
        clip_grad_norm_(parameters=vectors, max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients  # type: ignore[method-assign]


def _as_vector(param: torch.nn.Parameter) -> torch.nn.Parameter:
    if param.dim() != 0 or param.grad is None:
        return param
    vector = torch.nn.Parameter(param.data.view(1), requires_grad=param.requires_grad)
    vector.grad = param.grad.view(1)
    return vector


def torch_optimizer(engine: DeepSpeedEngine) -> Optimizer:
    """The torch optimizer DeepSpeed built from the engine's config (``engine.basic_optimizer``)."""
    return engine.basic_optimizer


def reentrant_checkpoint_functions() -> tuple[type, ...]:
    """DeepSpeed's reentrant activation-checkpoint autograd function (``checkpointing.CheckpointFunction``)."""
    try:
        from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction
    except ImportError:  # pragma: no cover - a DeepSpeed without it has no such nodes to find
        return ()
    return (CheckpointFunction,)


# ---- one backward: prologue, phases, epilogue ---------------------------------------------------------------


def enter_backward(engine: DeepSpeedEngine) -> None:
    """Run the engine's backward prologue as ``engine.backward`` does, and mark it as inside a backward.

    ``_running_engine_backward`` (and its count, under its lock) makes DeepSpeed's queued post-backward callback
    leave the epilogue to the caller, and lets stage 0 accept a direct ``tensor.backward()``. ZeRO's "gradient
    seen" flags are reset first, as ``engine.forward`` would before its backward.
    """
    with engine._running_engine_backward_lock:
        engine._running_engine_backward_count += 1
        engine._running_engine_backward = True
    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()
    engine._backward_prologue()


def end_backward(engine: DeepSpeedEngine, *, reduce: bool = True) -> None:
    """Run the engine's backward epilogue (``_backward_epilogue``): reduce, then leave ZeRO's backward context.

    With ``reduce=False`` the epilogue runs with DeepSpeed's no-sync flag set, so nothing is reduced: ZeRO-2
    cannot reduce an empty bucket (IndexError in ``reduce_ipg_grads``).
    """
    if reduce:
        engine._backward_epilogue()
        return
    engine.inside_no_sync_ctxt = True
    try:
        engine._backward_epilogue()
    finally:
        engine.inside_no_sync_ctxt = False


def leave_backward(engine: DeepSpeedEngine) -> None:
    """Undo :func:`enter_backward`'s mark, whether or not the backward completed."""
    with engine._running_engine_backward_lock:
        engine._running_engine_backward_count -= 1
        engine._running_engine_backward = engine._running_engine_backward_count > 0


def reduce_phase(engine: DeepSpeedEngine) -> None:
    """Reduce-scatter what a ZeRO-2/3 engine's bucket holds now, mid-backward, without leaving the backward.

    ``engine.allreduce_gradients()`` runs ZeRO's ``overlapping_partition_gradients_reduce_epilogue``; the
    "gradient seen" flags are then reset so that ZeRO-3 adds to (``micro_step_id > 0``) what was just reduced.
    """
    engine.allreduce_gradients()
    engine.optimizer.clear_backward_seen_flag()


def fill_missing_gradients(engine: DeepSpeedEngine) -> None:
    """Give each trainable parameter that holds no gradient a zero one, as DDP reduces for an unused parameter.

    A gradient is held in ``param.grad`` or, at ZeRO-1/2 with ``grad_accum_dtype``, in ``grad_accum``. A ZeRO-3
    parameter is partitioned after its backward (``param.data`` is empty): its whole-shape zero gradient is set
    through ``.data``, as ZeRO-3 sets its gradients itself.
    """
    for param in engine.module.parameters():
        if not param.requires_grad or param.grad is not None or getattr(param, "grad_accum", None) is not None:
            continue
        shape = full_shape(param)
        if param.shape == shape:
            param.grad = torch.zeros_like(param)
        else:
            param.grad = torch.zeros_like(param.data)
            param.grad.data = torch.zeros(shape, dtype=param.dtype, device=param.device)
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        engine.optimizer.setup_buckets()  # what the first gradient hook of a step does; step() reduces through them


def reduced_during_backward(engine: DeepSpeedEngine) -> bool:
    """Whether a ZeRO-2/3 engine already reduced some gradient in the running backward (a full bucket).

    ZeRO-2 and ZeRO-3 flag each parameter they reduce in ``params_already_reduced`` until the epilogue.
    """
    flags: Any = getattr(engine.optimizer, "params_already_reduced", None)
    if isinstance(flags, dict):
        return any(flags.values())
    return flags is not None and any(flags)


def take_back_bucketed_gradients(engine: DeepSpeedEngine) -> None:
    """Move the gradients a ZeRO-2/3 engine holds in its reduction buckets, none reduced yet, back into ``param.grad``.

    Each bucketed ``param.grad`` (``grad_accum`` at ZeRO-2 with ``grad_accum_dtype``) is a view into the bucket's
    contiguous buffer (``reduce_independent_p_g_buckets_and_remove_grads``); it gets its own copy, and the buckets
    (``ipg_buckets``: params, grads, element counts; ZeRO-2's ``extra_large_param_to_reduce``) are emptied, so that a
    later reduction can bucket them again in another order.
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        for bucket in optimizer.ipg_buckets.values():
            for grad in bucket.grads:
                grad.data = grad.data.clone()
            bucket.clear()
        optimizer.extra_large_param_to_reduce.clear()
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        for bucket in optimizer.ipg_buckets.values():
            for param in bucket.params:
                param.grad.data = param.grad.data.clone()
            bucket.clear_params()


def clear_gradients(engine: DeepSpeedEngine) -> None:
    """Clear every gradient ``engine`` holds for its next step (local, accumulated and reduced), as ``step()`` does.

    ``zero_grad()`` of ZeRO-1/2 only clears ``param.grad``; gradients a backward already reduced into the partition
    (``averaged_gradients``, ``all_grad_tensors``, the pre-flattened buffers) survive it, and ``micro_step_id``
    decides whether the next reduction adds or overwrites. ZeRO-3's ``zero_grad`` resets ``micro_step_id`` but adds a
    parameter first reduced later in the step to its flat partition buffer, which must not hold the last step's.
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if optimizer.cpu_offload:
            _clear_offloaded_accumulation(optimizer)
        optimizer._release_preflattened_grad_buffers()
        for index in range(len(optimizer.bit16_groups)):
            optimizer.averaged_gradients[index] = None
            optimizer.all_grad_tensors[index] = None
        optimizer.micro_step_id = _initial_micro_step_id()
        optimizer.zero_grad(set_to_none=True)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        for param in engine.module.parameters():  # whole local ones from `no_sync`: ZeRO-3's zero_grad() fails on CPU
            param.grad = None
        optimizer.zero_grad(set_to_none=True)
        optimizer.grad_partitions_flat_buffer.zero_()
        if optimizer.offload_optimizer:
            _clear_offloaded_zero3_gradients(optimizer)
    elif optimizer is not None:
        optimizer.zero_grad(set_to_none=True)  # torch optimizer, or BF16/FP16_Optimizer: lp and hp grads
    engine.zero_grad()  # param.grad of every module parameter


def _clear_offloaded_accumulation(optimizer: DeepSpeedZeroOptimizer) -> None:
    """Drop what a ZeRO-1/2 optimizer with ``offload_optimizer`` holds in host memory for its next step.

    Between steps it keeps each reached parameter's gradient in ``accumulated_grads_in_cpu`` and the parameter's id
    in ``_offload_accumulated_param_ids``; ``step()`` applies every listed parameter's buffer and only ``step()``
    resets the list. Left after ``zero_grad()``, a parameter not reached again before the step would get the cleared
    gradient applied. It also steps ``single_partition_of_fp32_groups[i].grad``, a buffer it allocates once and never
    clears (0.19.8: ``initialize_optimizer_states``, ``step``): each backward at the accumulation boundary copies in
    the slices of the parameters it reached, so a parameter reached at one step and not at the next was stepped
    again with its old gradient (plain DeepSpeed does the same when a step leaves a parameter unused). Both are
    zeroed, after the in-flight copies into them.
    """
    optimizer._wait_for_offload_copies()
    optimizer._offload_accumulated_param_ids.clear()
    for buffer in optimizer.accumulated_grads_in_cpu.values():
        buffer.zero_()
    _zero_gradients_of(optimizer.single_partition_of_fp32_groups)


def _clear_offloaded_zero3_gradients(optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    """Zero the host fp32 gradient partitions of a ZeRO-3 optimizer with ``offload_optimizer``.

    As at ZeRO-1/2, ``fp32_partitioned_groups_flat[i].grad`` is allocated once and only the slices of the
    parameters a step reached are copied in (0.19.8: ``_offload_grad_partition_at_boundary``), so the others kept
    the last step's gradient. The copies run on ``reduce_and_partition_stream``, waited for first.
    """
    _wait_for_zero3_partitioning(optimizer)
    _zero_gradients_of(optimizer.fp32_partitioned_groups_flat)


def _wait_for_zero3_partitioning(optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    """Wait for ZeRO-3's reductions and gradient copies, which run on its own stream (as DeepSpeed's reads do)."""
    if not get_accelerator().resolves_data_dependency():
        optimizer.reduce_and_partition_stream.synchronize()


def _zero_gradients_of(partitions: list[torch.Tensor]) -> None:
    for partition in partitions:
        if partition.grad is not None:  # None where a subgroup is swapped out to NVMe
            partition.grad.zero_()


def keeps_master_copy(engine: DeepSpeedEngine) -> bool:
    """Whether ``engine``'s optimizer steps a master copy of the weights, where :func:`take_weight_edits` takes edits.

    ZeRO-1/2 (any precision) and ZeRO-0/1 in bf16/fp16; not ZeRO-0 in fp32 (a torch optimizer steps the weights
    themselves), nor ZeRO-3 (edits go through ``gathered``, :func:`set_master_weights`).
    """
    optimizer = engine.optimizer
    return isinstance(optimizer, DeepSpeedZeroOptimizer | BF16_Optimizer | FP16_UnfusedOptimizer | FP16_Optimizer)


@torch.no_grad()
def take_weight_edits(engine: DeepSpeedEngine) -> None:
    """Carry edits of the engine's module weights since its last step into the optimizer's fp32 master copy.

    ZeRO-1/2 (``single_partition_of_fp32_groups``) and ZeRO-0/1 in bf16 (``BF16_Optimizer``'s
    ``fp32_groups_flat_partition``) step a master copy of this rank's partition and then overwrite the module's
    weights from it, so an in-place edit (``p.data.clamp_``, ``load_state_dict``) would be lost at the next step. Each
    master partition takes the module's partition (``parallel_partitioned_bit16_groups`` /
    ``bf16_partitioned_groups``; ``FP16_UnfusedOptimizer``'s ``fp16_groups`` and ``fp32_groups`` per parameter, which
    DeepSpeed uses for bf16 at ZeRO-0 with a torch optimizer; ``FP16_Optimizer``'s ``fp16_groups`` and views of its
    ``fp32_groups_flat``, for ZeRO-0 in bf16/fp16 with DeepSpeed's ``FusedAdam``) where they differ: in fp32 a copy;
    in bf16 the elements whose bf16 value is no longer the master's rounded, so that unedited weights keep their fp32
    precision; with an offloaded optimizer the master copy is in host memory, and the weights are read there. Not
    for ZeRO-3, whose weights outside ``forward`` are empty
    partitions (edits go through ``gathered(name, modifier_rank=...)``, :func:`set_master_weights`).
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        low, high = optimizer.parallel_partitioned_bit16_groups, optimizer.single_partition_of_fp32_groups
    elif isinstance(optimizer, BF16_Optimizer):
        low, high = optimizer.bf16_partitioned_groups, optimizer.fp32_groups_flat_partition
    elif isinstance(optimizer, FP16_UnfusedOptimizer):  # ZeRO-0 in bf16 (or fp16) with a torch optimizer
        for weights, master in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
            for pair in zip(weights, master, strict=True):
                _take_edits(*pair)
        return
    elif isinstance(optimizer, FP16_Optimizer):  # ZeRO-0 in bf16/fp16 with DeepSpeed's FusedAdam (a CUDA op)
        for weights, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat, strict=True):
            for pair in zip(weights, _unflatten_dense_tensors(flat, weights), strict=True):  # views of the master
                _take_edits(*pair)
        return
    else:  # a torch optimizer steps the module's own weights (ZeRO-0 in fp32); ZeRO-3: not carried
        return
    for index, (partitions, master) in enumerate(zip(low, high, strict=True)):
        _take_edits(partitions[torch.distributed.get_rank(group=optimizer.real_dp_process_group[index])], master)


@torch.no_grad()
def hold_still(engine: DeepSpeedEngine, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """Copy what the engine's next step may change of ``params`` on this rank; return what puts it back after.

    For parameters that got no gradient since the last clear, which ``torch.optim`` would skip while the engine's
    optimizer steps them with zero gradients (momentum, Adam's moments and weight decay still move them). Copied:
    the module's weights (at ZeRO-3 this rank's partition; the whole weights it keeps gathered are gathered again
    after, every rank alike, as the parameters are agreed), the fp32 master copy (ZeRO-1/2 and bf16
    ``_hp_mapping`` fragments, ZeRO-3's fp32 partition, ``FP16_UnfusedOptimizer``'s per-parameter copies) and the
    optimizer state of each. Where the torch optimizer's state has no entry for a parameter yet (ZeRO-0), the entry
    the step made is removed again; over ZeRO's flat partitions the state's step count is shared, and only the
    moments are put back.
    """
    optimizer = engine.optimizer
    views: list[torch.Tensor] = []
    made: list[tuple[dict, Any]] = []  # state entries that did not exist before the step
    if optimizer is torch_optimizer(engine) or isinstance(optimizer, FP16_UnfusedOptimizer):
        unfused = isinstance(optimizer, FP16_UnfusedOptimizer)
        state = optimizer.optimizer.state if isinstance(optimizer, FP16_UnfusedOptimizer) else optimizer.state
        copies = _fp32_copies(optimizer) if unfused else {}
        for param in params:
            stepped = copies.get(param, param)
            views += [param.data, *([stepped.data] if stepped is not param else [])]
            if stepped in state:
                views += [value for value in state[stepped].values() if isinstance(value, torch.Tensor)]
            else:
                made.append((state, stepped))
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        for param in params:
            views += _zero3_views(optimizer, param)
    else:  # ZeRO-1/2, BF16_Optimizer: fragments of this rank's flat partition
        for param in params:
            views.append(param.data)
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                views += [mapping.get_hp_fragment(), *_fragment_states(optimizer, mapping)]
    saved = [view.clone() for view in views]

    @torch.no_grad()
    def restore() -> None:
        for view, value in zip(views, saved, strict=True):
            view.copy_(value)
        for state, key in made:
            state.pop(key, None)
        if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):  # whole again from the partitions put back
            for param in params:
                if is_gathered(param):  # alike on every rank (the parameters are agreed): a collective
                    _gather_from_partitions(param)

    return restore


def _gather_from_partitions(param: torch.nn.Parameter) -> None:
    """Set the whole weights of a gathered ZeRO-3 ``param`` from every rank's partition (``ds_tensor``)."""
    local = param.ds_tensor  # type: ignore[attr-defined]
    group = param.ds_process_group  # type: ignore[attr-defined]
    whole = local.new_empty(local.numel() * torch.distributed.get_world_size(group=group))
    torch.distributed.all_gather_into_tensor(whole, local.view(-1), group=group)
    param.data.view(-1).copy_(whole.narrow(0, 0, param.numel()))


def _fragment_states(optimizer: DeepSpeedZeroOptimizer | BF16_Optimizer, mapping: Any) -> list[torch.Tensor]:
    """A ZeRO-1/2 (or ``BF16_Optimizer``) parameter's fragment of each optimizer state of its flat fp32 partition.

    Read from the optimizer's state by the fragment's address (``_hp_mapping.hp_fragment_address``), not from the
    mapping's own links (``optim_fragment``), which DeepSpeed makes only at the first step after the mappings are
    built, again after loading a checkpoint, and not after ``reload_states()``.
    """
    index = mapping.param_group_index
    flats = (
        optimizer.single_partition_of_fp32_groups
        if isinstance(optimizer, DeepSpeedZeroOptimizer)
        else optimizer.fp32_groups_flat_partition
    )
    flat, address = flats[index], mapping.hp_fragment_address
    return [
        value.narrow(0, address.start, address.numel)
        for value in optimizer.optimizer.state.get(flat, {}).values()
        if isinstance(value, torch.Tensor) and value.shape == flat.shape
    ]


def _fp32_copies(optimizer: FP16_UnfusedOptimizer) -> dict[torch.nn.Parameter, torch.Tensor]:
    """``FP16_UnfusedOptimizer``'s fp32 copy of each 16-bit parameter, which its torch optimizer steps."""
    pairs = zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True)
    return {low: high for lows, highs in pairs for low, high in zip(lows, highs, strict=True)}


def _zero3_views(optimizer: DeepSpeedZeroOptimizer_Stage3, param: torch.nn.Parameter) -> list[torch.Tensor]:
    """The partition of a ZeRO-3 ``param`` on this rank: its weights, fp32 master copy and optimizer states.

    Where ZeRO-3 keeps the parameter whole (a small one, kept gathered), the step gathers it again from the
    partitions it changed: :func:`hold_still` gathers it once more after putting them back.
    """
    views = [partition(param)[0]]
    master, group = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False)
    views.append(master)
    flat = optimizer.fp32_partitioned_groups_flat[group]
    for key, value in optimizer.optimizer.state.get(flat, {}).items():
        if isinstance(value, torch.Tensor) and value.shape == flat.shape:
            views.append(optimizer._get_fp32_opt_state_partition(param, False, optim_state_key=key)[0])
    return views


def _take_edits(weights: torch.Tensor, master: torch.Tensor) -> None:
    """Set ``master`` to ``weights`` where ``weights`` is no longer ``master`` in its dtype (all of it in one dtype).

    An offloaded optimizer's ``master`` is in host memory: ``weights`` are read there.
    """
    weights = weights.to(master.device)
    if weights.dtype == master.dtype:
        master.copy_(weights)
    else:
        torch.where(weights != master.to(weights.dtype), weights, master, out=master)


@torch.no_grad()
def set_master_weights(param: torch.nn.Parameter) -> None:
    """Set the fp32 master copy of a whole trained ``param`` (ZeRO-1/2/3, bf16) to ``param``'s values; a collective.

    With DeepSpeed's ``safe_get_full_fp32_param`` and, at ZeRO-1/2 and bf16 at ZeRO-0, ``safe_set_full_fp32_param``.
    In a 16-bit dtype only the elements whose value is no longer the master's rounded take it, as in
    :func:`take_weight_edits`. Nothing for a parameter without a master copy (frozen; ZeRO-0 in fp32, whose
    optimizer steps the module's own weights; ZeRO-0 in bf16 with a torch optimizer, which
    :func:`take_weight_edits` carries at the step). Every rank calls it for the same parameters in the same order.
    """
    master = safe_get_full_fp32_param(param)
    if master is None:
        return
    value = param.data.to(master.device).reshape(master.shape)
    if value.dtype != master.dtype:
        value = torch.where(value != master.to(value.dtype), value.to(master.dtype), master)
    if hasattr(param, "ds_id"):
        _set_zero3_master(param, value)
    else:
        safe_set_full_fp32_param(param, value)


def _set_zero3_master(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's part of ZeRO-3's fp32 partition of ``param`` from its whole fp32 ``value``.

    DeepSpeed's own ``set_full_hp_param`` (0.19.8) reads a whole partition's length from ``value`` on every rank,
    past the end of a parameter whose size the world size does not divide (the last partition is padded).
    """
    optimizer = param._z3_optimizer  # type: ignore[attr-defined]  # DeepSpeed's link, set at ZeRO-3
    partition, group = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False)
    flat, start = value.flatten(), partition.numel() * optimizer._get_param_partition_rank(param)
    count = max(0, min(partition.numel(), flat.numel() - start))
    partition.narrow(0, 0, count).copy_(flat.narrow(0, start, count))
    if optimizer._swappable_optimizer_subgroup(group):
        optimizer._optimizer_states_and_gradient_swap_out(group)


def clear_after_step(engine: DeepSpeedEngine) -> None:
    """Clear what ``engine.step()`` leaves of the step's gradients once it returns (applied or skipped).

    ``step()`` clears ``param.grad``, the optimizer's local and reduced gradients and ZeRO-1/2's partitions and
    ``micro_step_id`` itself (0.19.8: ``_take_model_step``, ``DeepSpeedZeroOptimizer.step``). ZeRO-3 leaves its
    flat partition buffer, into which a parameter first reduced after the first backward of the next step adds.
    With ``offload_optimizer`` every stage leaves the host fp32 gradient partition, which the next step would
    apply again to every parameter that step does not reach; ZeRO-1/2 also leave their host accumulation buffers
    (``accumulated_grads_in_cpu``), which a reduction after the first of a step adds (``micro_step_id > 0``: a
    reentrant checkpoint's phase closed mid-backward, or a second backward before the step), so the next step
    would add this one's gradients again (:func:`_clear_offloaded_accumulation`).
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        optimizer.grad_partitions_flat_buffer.zero_()
        if optimizer.offload_optimizer:
            _clear_offloaded_zero3_gradients(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.cpu_offload:
        _clear_offloaded_accumulation(optimizer)


def undo_initial_step(engine: DeepSpeedEngine) -> None:
    """Undo the step DeepSpeed's fp16/bf16 stage-0 wrappers take with zero gradients when they are built.

    ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` (ZeRO-0 with fp16, or bf16 with an optimizer other than
    ``BF16_Optimizer``'s) call the wrapped optimizer's ``step()`` once on zero gradients to create its state
    (0.19.8: ``initialize_optimizer_states``). Adam then counts a step it never took, so its first real update
    is 0.74 of plain PyTorch's; weight decay shrinks the fp32 master weights once. PyTorch's optimizers create
    their state at their first step: the state is dropped (Adagrad's, made at construction, is set back to what
    the constructor made) and the master weights are copied again from the module's. A step count an optimizer
    keeps in its parameter groups instead of its state (not torch's) still counts the extra step.
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, FP16_Optimizer):
        masters = list(zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat, strict=True))
    elif isinstance(optimizer, FP16_UnfusedOptimizer):
        masters = [
            pair
            for hp, lp in zip(optimizer.fp32_groups, optimizer.fp16_groups, strict=True)
            for pair in zip(hp, lp, strict=True)
        ]
    else:
        return
    inner = optimizer.optimizer
    if isinstance(inner, torch.optim.Adagrad):  # as its constructor left it: weight decay made the sums nonzero
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param]["step"].zero_()
                inner.state[param]["sum"].fill_(group["initial_accumulator_value"])
    else:
        inner.state.clear()
    with torch.no_grad():
        for master, weights in masters:
            master.copy_(weights)


def _initial_micro_step_id() -> int:
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    return int(INITIAL_MICRO_STEP_ID)


def abandon_backward(engine: DeepSpeedEngine) -> None:
    """Return ``engine`` to a clean state after an exception ended its backward early; no collective.

    The prologue ran and the epilogue did not: ZeRO's backward depth (``_backward_active_depth``) stays raised;
    ZeRO-1/2 keep gradients in the reduction bucket and ``params_already_reduced`` flags, which make the next
    epilogue reduce stale gradients or assert; ZeRO-3 keeps parameters in its bucket. All of it is reset, and every
    gradient the engine holds for this step is dropped (:func:`clear_gradients`).
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

    ``engine.step()`` marks itself as the accumulation boundary (``_running_engine_step``) until it returns; left
    set, every later backward would reduce as if at the boundary. The caller then clears the gradients.
    """
    engine._running_engine_step = False
    _reset_reduction(engine.optimizer)


def _reset_reduction(optimizer: Any) -> None:
    """Empty a ZeRO optimizer's reduction buckets and its per-parameter "already reduced" flags."""
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


# ---- no_sync: gradients kept local, reduced once ------------------------------------------------------------


def in_no_sync(engine: DeepSpeedEngine) -> bool:
    """Whether the engine's gradients stay local (DeepSpeed's ``inside_no_sync_ctxt``, set by :func:`start_no_sync`)."""
    return bool(getattr(engine, "inside_no_sync_ctxt", False))


def start_no_sync(engine: DeepSpeedEngine) -> None:
    """Keep the engine's gradients local in later backwards, as DeepSpeed's ``coalesce_grad_reduction()`` does.

    ``inside_no_sync_ctxt`` stops the epilogue's reduction (stage 0/1 reduce only in ``step()`` anyway) and makes
    ``engine.step()`` refuse to run; ZeRO-2/3's ``_coalesce_grad_reduction`` makes their gradient hooks leave whole
    gradients in ``param.grad`` instead of bucketing them.
    """
    engine.inside_no_sync_ctxt = True
    if engine.zero_optimization_partition_gradients():
        engine.optimizer._coalesce_grad_reduction = True


def stop_no_sync(engine: DeepSpeedEngine) -> None:
    """Undo :func:`start_no_sync` without reducing anything."""
    engine.inside_no_sync_ctxt = False
    if engine.zero_optimization_partition_gradients():
        engine.optimizer._coalesce_grad_reduction = False


def reduce_local_gradients(engine: DeepSpeedEngine) -> None:
    """Reduce-scatter the gradients a ZeRO-2/3 engine accumulated locally, with DeepSpeed's own flush.

    ``_flush_coalesced_reduction_zero12/3`` is what ``coalesce_grad_reduction()`` runs on exit; the accumulation
    boundary stays off here, so what is reduced adds to the partitions rather than replacing them.
    """
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        engine._flush_coalesced_reduction_zero3(engine.optimizer)
    elif engine.zero_optimization_partition_gradients():
        engine._flush_coalesced_reduction_zero12(engine.optimizer)


# ---- reading gradients between backward and step ---------------------------------------------------------------


def local_gradient(param: torch.nn.Parameter) -> torch.Tensor:
    """A stage 0/1 parameter's accumulated, unreduced gradient, in fp32 (zeros if it has none).

    ``BF16_Optimizer`` (bf16 at stage 1 with ``data_types.grad_accum_dtype: fp32``) accumulates each
    backward's ``param.grad`` into the fp32 ``_hp_grad`` in its epilogue and clears ``param.grad`` in the next
    prologue, so ``param.grad`` holds only the last backward's share: ``_hp_grad`` is read first. ZeRO-1 may park the
    gradient in ``grad_accum``.
    """
    grad = getattr(param, "_hp_grad", None)
    if grad is None:
        grad = param.grad if param.grad is not None else getattr(param, "grad_accum", None)
    return torch.zeros_like(param, dtype=torch.float32) if grad is None else grad.detach().float().clone()


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """The parameter's whole shape, also when ZeRO-3 holds only a partition of it (``ds_shape``)."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def gradient_accumulator(param: torch.nn.Parameter) -> Any:
    """The node that accumulates ``param``'s gradient, made for its whole shape also where ZeRO-3 partitioned it.

    torch records a parameter's shape in its accumulator when it makes one, and checks every gradient against it;
    ZeRO-3's gradients are whole. So a partitioned parameter's accumulator is made while its ``data`` is a whole-shape
    view of a single element (no memory, no collective), then the partition is put back: the accumulator stays, as
    long as something holds it, across ``data`` changes of one dtype and device.
    """
    shape = full_shape(param)
    if param.shape == shape:
        return torch_compat.gradient_accumulator(param)
    partition = param.data
    param.data = torch.empty((), dtype=partition.dtype, device=partition.device).expand(shape)
    try:
        return torch_compat.gradient_accumulator(param)
    finally:
        param.data = partition


def whole_numel(param: torch.nn.Parameter) -> int:
    """The parameter's number of elements, whole, also when ZeRO-3 holds only a partition of it (``ds_numel``)."""
    return int(param.ds_numel) if is_zero_param(param) else param.numel()  # type: ignore[attr-defined]


def numel_on_rank(param: torch.nn.Parameter) -> int:
    """The elements this rank holds: a ZeRO-3 parameter's partition (``partition_numel()``), else all of them."""
    return int(param.partition_numel()) if is_zero_param(param) else param.numel()  # type: ignore[attr-defined]


def gathered_gradients(
    engine: DeepSpeedEngine, name: str, params: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    """The whole reduced gradients of a ZeRO-2/3 engine's ``params``, with DeepSpeed's ``safe_get_full_grad``.

    ``safe_get_full_grad`` reads ZeRO-2's reduced fragments only at the accumulation boundary
    (``averaged_gradients``); here they are built for it from the accumulated partition while it reads.

    Raises:
        NotImplementedError: a ZeRO-2 engine with an offloaded optimizer or an fp32 gradient accumulator, which
            keep the reduced gradients elsewhere until ``step()``.
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        if optimizer.offload_optimizer:
            return {key: _offloaded_zero3_gradient(optimizer, param) for key, param in params.items()}
        return {key: safe_get_full_grad(param) for key, param in params.items()}
    _refuse_unexposed_fragments(optimizer, name)
    with _reduced_fragments_exposed(optimizer):
        return {key: safe_get_full_grad(param) for key, param in params.items()}


def _offloaded_zero3_gradient(optimizer: DeepSpeedZeroOptimizer_Stage3, param: torch.nn.Parameter) -> torch.Tensor:
    """A ZeRO-3 parameter's whole reduced gradient while ``offload_optimizer`` is set, before ``step()``.

    ``safe_get_full_grad`` reads the host fp32 partition then, which holds this step's gradient only once
    ``step()`` has copied it in (0.19.8: ``get_fp32_grad_for_param``, ``_finalize_offload_gradient_accumulation``).
    Until then the gradient is in the partition buffer the backward accumulates into, gathered here as
    ``get_fp32_grad_for_param`` gathers it without offload.
    """
    _wait_for_zero3_partitioning(optimizer)
    partition = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition[param.ds_id]  # type: ignore[attr-defined]
    return optimizer._fp32_state_allgather(param, partition.to(get_accelerator().current_device_name()).float())


def _refuse_unexposed_fragments(optimizer: DeepSpeedZeroOptimizer, name: str) -> None:
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


# ---- precision, clipping, non-finite steps --------------------------------------------------------------------


def loss_scale(engine: DeepSpeedEngine) -> float:
    """The factor ``engine``'s optimizer divides gradients by in ``step()``: its fp16 loss scale, else 1.

    ZeRO optimizers expose it as ``loss_scale``, ``FP16_Optimizer`` (stage 0) as ``cur_scale``.
    """
    if not engine.fp16_enabled():
        return 1.0
    scale: Any = getattr(engine.optimizer, "loss_scale", None)
    if scale is None:
        scale = getattr(engine.optimizer, "cur_scale", 1.0)
    return float(scale)


def set_gradient_clipping(engine: DeepSpeedEngine, max_norm: float) -> None:
    """Make ``engine.step()`` clip the reduced gradients to global norm ``max_norm`` (0 turns clipping off).

    The engine reads ``gradient_clipping`` from its config (``_config``) at stage 0; ZeRO and bf16 optimizers copy
    it into ``clip_grad`` when built, so both are set.
    """
    engine._config.gradient_clipping = float(max_norm)
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = float(max_norm)


def ensure_nonfinite_check(engine: DeepSpeedEngine) -> bool:
    """Make DeepSpeed skip a step whose reduced gradients hold a NaN or inf, where it can; whether it now does.

    It does already, and ``engine.skipped_steps`` grows, for fp16 engines (the loss scaler), bf16 at stage 0
    (``FP16_Optimizer``/``FP16_UnfusedOptimizer`` over bf16 weights: their overflow check), bf16 at stage 1 with
    fp32 accumulation (``BF16_Optimizer``) and ZeRO-3 (a non-finite global norm). ZeRO-1/2 check with
    ``check_grad_overflow`` (bf16) or the global norm (fp32, ``compute_grad_norm``): a config that turns its check
    off gets ``check_grad_overflow`` back on. A plain torch optimizer (stage 0, fp32) checks nothing: False.
    """
    optimizer = engine.optimizer
    checking = BF16_Optimizer | FP16_Optimizer | FP16_UnfusedOptimizer | DeepSpeedZeroOptimizer_Stage3
    if engine.fp16_enabled() or isinstance(optimizer, checking):
        return True
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if not (optimizer.compute_grad_norm and optimizer.dtype != torch.bfloat16):
            optimizer.check_grad_overflow = True
        return True
    return False


# ---- ZeRO-3 partitions, for EMA engines -------------------------------------------------------------------------


def partition(param: torch.nn.Parameter) -> tuple[torch.Tensor, int]:
    """The partition of a ZeRO-3 parameter that this rank holds, without padding, and its offset in the whole.

    ``partition_parameters.Init._partition_param``: rank r of ``ds_process_group`` holds elements
    ``[r * P, r * P + P)`` of the flattened parameter in ``ds_tensor`` (``P = ds_tensor.ds_numel``); the last
    rank's is padded past ``ds_numel``. The returned 1-D view writes into the partition itself.
    """
    local = param.ds_tensor  # type: ignore[attr-defined]
    size = int(local.ds_numel)
    start = size * torch.distributed.get_rank(group=param.ds_process_group)  # type: ignore[attr-defined]
    valid = max(0, min(size, int(param.ds_numel) - start))  # type: ignore[attr-defined]
    return local.view(-1).narrow(0, 0, valid), start


def same_partitioning(a: torch.nn.Parameter, b: torch.nn.Parameter) -> bool:
    """Whether two ZeRO-3 parameters of one shape are split alike: the same process group and partition size."""
    return bool(
        a.ds_process_group is b.ds_process_group  # type: ignore[attr-defined]
        and a.ds_tensor.ds_numel == b.ds_tensor.ds_numel  # type: ignore[attr-defined]
    )


def is_gathered(param: torch.nn.Parameter) -> bool:
    """Whether a ZeRO-3 parameter is whole on this rank now (``ds_status`` AVAILABLE: a persistent parameter).

    A parameter at or under ``stage3_param_persistence_threshold`` stays gathered between forwards, beside its
    partition; a change to it must reach both.
    """
    return bool(param.ds_status == ZeroParamStatus.AVAILABLE)  # type: ignore[attr-defined]


def is_empty_partition(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 ``param`` holds only this rank's partition now (``ds_status`` NOT_AVAILABLE: an empty tensor)."""
    return getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE


def in_use(param: torch.Tensor) -> bool:
    """Whether a forward or backward of a submodule that holds ZeRO-3 ``param`` runs now (``ds_active_sub_modules``).

    Its weights are whole there; elsewhere they are this rank's partition, or, for a persistent (small) parameter,
    whole but overwritten from the partition at the next step.
    """
    return bool(getattr(param, "ds_active_sub_modules", None))


def _zero3_offload(engine: DeepSpeedEngine) -> DeepSpeedZeRoOffload:
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    if not isinstance(offload, DeepSpeedZeRoOffload):
        _refuse_missing("DeepSpeedZeRoOffload (the ZeRO-3 parameter hooks)")
    return offload


def release_after_backward(engine: DeepSpeedEngine) -> None:
    """Release the submodules of a ZeRO-3 ``engine`` that a backward gathered and no hook released.

    DeepSpeed releases a submodule's parameters once its backward has seen the gradient of every input that needed
    one, and restarts that count at each forward of the submodule (0.19.8: ``_post_backward_module_hook``). A
    submodule called twice before a backward, the first time on an input that needs a gradient (a frozen critic on
    G's output, then on data), is never released by the backward and its parameters stay marked in use: the next
    partition (``consolidated_state_dict``, a checkpoint) fails. A trained engine's epilogue releases such leftovers
    (``release_backward_leftovers``); a frozen engine has no epilogue, so it is called here, after every backward.
    A no-op when nothing is left.
    """
    _zero3_offload(engine).release_backward_leftovers()


def refuse_second_order(engine: DeepSpeedEngine, refuse: Callable[[], None]) -> None:
    """Call ``refuse()`` where a backward with grad mode on (``create_graph=True``) is about to gather a submodule.

    ZeRO-3 gathers a submodule's weights at the start of its backward: every forward of every submodule wraps its
    outputs in an autograd Function whose backward calls ``DeepSpeedZeRoOffload.pre_sub_module_backward_function``,
    looked up on the instance at each call (0.19.8: ``_register_deepspeed_module``). Set on the instance, the check
    sees every backward into every submodule, however it was called: the engine's forward, a submodule on its own, a
    penalty computed inside the forward. Grad mode inside a backward is its ``create_graph``. One Python call per
    submodule and backward; :func:`release_engine` takes it off with the engine.
    """
    offload = _zero3_offload(engine)
    gather = offload.pre_sub_module_backward_function

    def checked(sub_module: torch.nn.Module) -> None:
        if torch.is_grad_enabled():
            refuse()
        gather(sub_module)

    offload.pre_sub_module_backward_function = checked  # type: ignore[method-assign]


def discover_external_parameters(engine: DeepSpeedEngine, refuse: Callable[[str, str], None]) -> list[RemovableHandle]:
    """Let ZeRO-3 gather a weight used outside its owner's forward wherever user code calls a submodule.

    A forward that reads another submodule's weight (``x @ self.embedding.weight`` before ``self.embedding(...)``, a
    language-model head tied to the embedding) meets an empty partition, unless DeepSpeed's parameter getter
    gathers it and registers it as an external parameter of the running submodule, which it does only while
    ``module._parameters._in_forward`` is set (0.19.8: ``ZeROOrderedDict.__getitem__``). The engine's forward
    prologue sets it on every submodule, so a call of the engine's own module finds such weights; a part of a
    joined engine or a child called directly by user code runs without it, and the user's code failed with
    torch's ``IndexError``. These hooks set it on every submodule of the engine while any of them runs, and clear
    it when the outermost call ends, by an exception too. Two Python calls per submodule call; the flags are set
    once per outermost call.

    Outside every forward of the engine the getter finds nothing to gather for: there each attribute read of a
    partitioned parameter (``self.net.embed.weight``) runs ``refuse(qualified_name, reader)``, where ``reader``
    names the code that read it (the module's ``__name__``, ``reset_parameters`` after it where that method read
    it), to raise. Every ``_parameters`` of the engine's module has a subclass of DeepSpeed's class meanwhile;
    removing the last handle gives each its class back.
    """
    modules = list(engine.module.modules())
    depth = [0]
    for module in modules:
        ensure_zero_ordered_dict(module)
    named = {module: prefix for prefix, module in engine.module.named_modules()}
    originals = [(module._parameters, type(module._parameters)) for module in modules]
    for parameters, original in originals:
        parameters.__class__ = _checked_parameters(original, named, refuse)

    def mark(running: bool) -> None:
        for module in modules:
            module._parameters._in_forward = running  # type: ignore[union-attr]

    def enter(module: torch.nn.Module, args: Any) -> None:
        if depth[0] == 0:
            mark(True)
        depth[0] += 1

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if depth[0] == 0:  # a pre-hook put before `enter` raised: `enter` did not run for this call
            return
        depth[0] -= 1
        if depth[0] == 0:
            mark(False)

    def restore() -> None:
        for parameters, original in originals:
            parameters.__class__ = original

    # First of the pre-hooks (DeepSpeed's gather, torch's `weight_norm`, the user's): those read weights too.
    handles = [module.register_forward_pre_hook(enter, prepend=True) for module in modules]
    handles += [module.register_forward_hook(leave, always_call=True) for module in modules]
    return [*handles, _Undo(restore)]


class _Undo(RemovableHandle):
    """A handle whose ``remove()`` runs ``undo`` once."""

    def __init__(self, undo: Callable[[], None]) -> None:
        super().__init__(collections.OrderedDict())
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def _checked_parameters(
    original: type[Any], named: dict[torch.nn.Module, str], refuse: Callable[[str, str], None]
) -> type:
    def getitem(parameters: Any, key: str) -> Any:
        param = original.__getitem__(parameters, key)
        if param is not None and not parameters._in_forward and is_empty_partition(param):
            caller = _caller(sys._getframe(1))
            if not _answered_alike(caller):
                prefix = named.get(parameters._parent_module, "")
                refuse(f"{prefix}.{key}" if prefix else key, _reader(caller))
        return param

    namespace = {"__module__": original.__module__, "__qualname__": original.__qualname__, "__getitem__": getitem}
    return type(original.__name__, (original,), namespace)


def _caller(frame: Any) -> Any:
    """The frame of the code that read a parameter attribute: past ``Module.__getattr__`` (and a subclass's)."""
    while frame is not None and frame.f_code.co_name == "__getattr__":
        frame = frame.f_back
    return frame


def _reader(frame: Any) -> str:
    """The ``__name__`` of ``frame``'s code; where its function is a ``reset_parameters``, its name after it."""
    if frame is None:
        return ""
    reader = str(frame.f_globals.get("__name__", ""))
    return f"{reader}.{frame.f_code.co_name}" if "reset_parameters" in frame.f_code.co_name else reader


_ANSWERED = ("requires_grad", "requires_grad_", "dtype", "device", "is_leaf", "ds_shape", "ds_numel", "ds_id")
"""What a partition answers as the whole weight would: read (or, for ``requires_grad``, set) on it, it passes."""


def _answered_alike(frame: Any) -> bool:
    """Whether ``frame`` read the parameter for what its partition answers as the whole weight would.

    That is: a metadata read or a ``requires_grad`` flip right after it (``fc.weight.dtype``,
    ``fc.weight.requires_grad_(False)``), or a read by a call rather than an attribute of the code
    (``hasattr(fc, "weight")``, ``getattr(fc, "bias", None)``). Reads CPython's bytecode (``dis``), only where the
    strategy is about to refuse.
    """
    if frame is None:
        return False
    instructions = list(dis.get_instructions(frame.f_code))
    now = next((i for i in instructions if i.offset == frame.f_lasti), None)
    if now is None or now.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
        return True
    after = next((i for i in instructions if i.offset > frame.f_lasti), None)
    touched = ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR")
    return after is not None and after.opname in touched and after.argval in _ANSWERED


def suspend_zero3_hooks(engine: DeepSpeedEngine) -> Callable[[], None]:
    """Take ZeRO-3's per-submodule gather/release hooks off the engine's module; return what puts them back.

    ``DeepSpeedZeRoOffload`` (``engine.optimizer.parameter_offload`` of a trained engine, ``engine.optimizer`` of
    a frozen one) keeps them in ``forward_hooks`` and ``backward_hooks``; ``_register_deepspeed_module`` registers
    them again and invalidates the recorded prefetch trace. Each parameter's ``ds_active_sub_modules`` is
    cleared, so no hook run before counts the whole parameter as in use (as TRL does around ``generate``).
    """
    offload = _zero3_offload(engine)
    for param in engine.module.parameters():
        param.ds_active_sub_modules.clear()  # type: ignore[attr-defined]
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []

    def restore() -> None:
        offload._register_deepspeed_module(offload.module)

    return restore


# ---- teardown, checkpoints, diagnostics ---------------------------------------------------------------------


def release_engine(engine: DeepSpeedEngine) -> None:
    """``engine.destroy()``, then drop what it leaves that would keep the engine alive as long as its module.

    ``destroy()`` removes ZeRO's gradient and gather/release hooks, but not the engine's own forward hooks on the
    module (``module_forward_pre_hook``/``_post_hook``), each ZeRO-3 parameter's ``_z3_optimizer`` link, nor the
    autograd Functions ZeRO-3 keeps on each submodule (``pre_bwd_fn``/``post_bwd_fn``, made once per submodule and
    bound to the engine that made them: the next engine on the module would gather for its backwards through
    this one's hooks, and :func:`refuse_second_order`'s check would not run).
    """
    engine.destroy()
    if engine.zero_optimization_partition_weights():
        _zero3_offload(engine).__dict__.pop("pre_sub_module_backward_function", None)  # refuse_second_order's check
        forget_zero3_module_state(engine.module)
    for handle in (engine.module_forward_pre_hook, engine.module_forward_post_hook):
        if handle is not None:
            handle.remove()
    for param in engine.module.parameters():
        param.__dict__.pop("_z3_optimizer", None)


def forget_zero3_module_state(module: torch.nn.Module) -> None:
    """Drop what ZeRO-3 set on each submodule of ``module`` for its backward: two Functions, two counters."""
    for sub in module.modules():
        for name in _ZERO3_MODULE_STATE:
            sub.__dict__.pop(name, None)


_ZERO3_MODULE_STATE = ("pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt", "ds_grads_remaining")
"""What ZeRO-3 sets on each submodule once and reads back at the next engine's registration (0.19.8:
``DeepSpeedZeRoOffload._register_deepspeed_module`` makes the two Functions only where ``pre_bwd_fn`` is missing)."""


@contextmanager
def loading_universal(engine: DeepSpeedEngine) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read a universal checkpoint (``ds_to_universal``'s output) in the block.

    DeepSpeed reads its config's ``checkpoint.load_universal`` only when loading
    (``engine.load_universal_checkpoint()`` returns ``engine._config.load_universal_checkpoint``), so the flag is
    set for the load alone and the engine's config is as it was after the block.
    """
    if not hasattr(engine._config, "load_universal_checkpoint"):
        _refuse_missing("DeepSpeedConfig.load_universal_checkpoint")
    before = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = before


def to_universal(source: Path, target: Path) -> None:
    """Convert the ZeRO-1/2/3 checkpoint folder ``source`` (one tag) to a universal checkpoint in ``target``.

    ``deepspeed.checkpoint.ds_to_universal.main`` with its command line's options as arguments, in this process
    (one worker: no process pool), its progress output silenced. It also writes ``latest_universal`` beside
    ``target``, naming it.
    """
    from deepspeed.checkpoint import ds_to_universal

    options = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the engines save no `universal_checkpoint_info`; it only holds a version
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(options)


def checkpoint_globals() -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """The DeepSpeed classes its checkpoint files hold besides tensors and plain types, to allow in restricted loads.

    Found by saving engines at ZeRO 0-3 in fp32 and bf16, with Adam, AdamW and SGD, offloaded or not, and their
    universal checkpoints, and listing each file's globals (``torch.serialization.get_unsafe_globals_in_checkpoint``):
    ZeRO-1/2/3 optimizer states hold the loss scaler (``DynamicLossScaler`` in fp16) and ``ZeroStageEnum``, bf16
    ones the ``fragment_address`` of each parameter. Each is a plain record: building one runs no other code.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _saved_model_states(folder: Path, *, weights_only: bool) -> dict[str, Any]:
    """What an engine saved with ``engine.save_checkpoint`` into ``folder`` (one tag) besides its optimizer.

    ``mp_rank_00_model_states.pt`` (one model-parallel rank); at ZeRO-3 rank 0's
    ``zero_pp_rank_0_mp_rank_00_model_states.pt``, whose parameters are empty partitions and buffers whole.
    """
    file = folder / "mp_rank_00_model_states.pt"
    if not file.is_file():
        file = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return torch.load(file, map_location="cpu", weights_only=weights_only)


def saved_module_state(folder: Path, *, weights_only: bool) -> dict[str, torch.Tensor]:
    """The module ``state_dict`` an engine saved into ``folder`` (see :func:`_saved_model_states`)."""
    return dict(_saved_model_states(folder, weights_only=weights_only)["module"])


def saved_world_size(folder: Path, *, weights_only: bool) -> int:
    """The data-parallel world size an engine saved ``folder`` at (its model states' ``dp_world_size``)."""
    return int(_saved_model_states(folder, weights_only=weights_only)["dp_world_size"])


def stage0_weights(engine_dir: Path, tag: str, *, weights_only: bool) -> dict[str, torch.Tensor]:
    """The module weights a stage-0 engine saved with ``engine.save_checkpoint`` (its ``mp_rank_00`` file)."""
    return saved_module_state(engine_dir / tag, weights_only=weights_only)


def stage0_optimizer_state(engine_dir: Path, tag: str) -> dict[str, Any]:
    """The ``state_dict()`` of the torch optimizer a stage-0 engine saved (its model states' ``optimizer`` entry).

    In fp32 that entry is the torch optimizer's own; in bf16/fp16 it is DeepSpeed's wrapper's, holding the torch
    optimizer's (over fp32 copies of the parameters, in their order) under ``optimizer_state_dict``. Loaded
    unrestricted: only for files this process has just written.
    """
    saved = _saved_model_states(engine_dir / tag, weights_only=False)["optimizer"]
    return dict(saved.get("optimizer_state_dict", saved))


def universal_optimizer_state(universal: Path, groups: list[list[str]]) -> dict[str, Any]:
    """A universal checkpoint's optimizer state (:func:`to_universal`) as torch's ``optimizer.state_dict()``.

    ``groups`` names the parameters of each of the optimizer's groups, in its order. The universal checkpoint holds
    ``zero/NAME/KEY.pt`` per parameter and state key (``fp32.pt``, its master weight, is no optimizer state; ``step``
    a tensor, the others ``{"param": tensor}``, flat at ZeRO-3: shaped here as the model states' ``param_shapes``
    say) and the groups' settings in ``zero/optimizer_state.pt``, which at ZeRO-3 also holds the step count (one for
    every parameter, as DeepSpeed's own universal load reads it; 0.19.8 writes no ``step.pt`` there). Loaded
    unrestricted: only for a conversion this process has just made.
    """
    zero = universal / "zero"
    saved = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
    settings, step = (
        saved["param_groups"],
        saved.get("optimizer_state_dict", {}).get("state", {}).get(0, {}).get("step"),
    )
    shapes = {
        k: v for group in _saved_model_states(universal, weights_only=False)["param_shapes"] for k, v in group.items()
    }
    state: dict[int, dict[str, Any]] = {}
    param_groups, index = [], 0
    for group, names in zip(settings, groups, strict=True):
        settings_only = {key: value for key, value in group.items() if key != "params"}
        param_groups.append({**settings_only, "params": list(range(index, index + len(names)))})
        for name in names:
            entries = _universal_entries(zero / name, shapes[name])
            if entries and "step" not in entries and step is not None:
                entries["step"] = step
            if entries:
                state[index] = entries
            index += 1
    return {"state": state, "param_groups": param_groups}


def _universal_entries(folder: Path, shape: torch.Size) -> dict[str, torch.Tensor]:
    """One parameter's optimizer state in a universal checkpoint (``folder``; none if missing), shaped ``shape``."""
    state = {}
    for file in sorted(folder.glob("*.pt")) if folder.is_dir() else []:
        if file.stem != "fp32":  # the master weight
            value = torch.load(file, map_location="cpu", weights_only=False)
            value = value["param"] if isinstance(value, dict) else value
            state[file.stem] = value.view(shape) if value.dim() else value
    return state


REDUCTION_CALLS: dict[int, tuple[str, str]] = {
    # stage: (object, method) that DeepSpeed calls once per reduction round (per bucket at ZeRO-2/3)
    0: ("engine", "buffered_allreduce_fallback"),
    1: ("optimizer", "reduce_gradients"),
    2: ("optimizer", "average_tensor"),
    3: ("optimizer", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"),
}
"""Where to count an engine's gradient reductions (:class:`lightning_multids.utilities.ReductionCounter`)."""


def reduction_call(engine: DeepSpeedEngine) -> tuple[Any, str]:
    """The object and method name that DeepSpeed calls once per gradient reduction round of ``engine``."""
    owner, method = REDUCTION_CALLS[engine.zero_optimization_stage()]
    return (engine if owner == "engine" else engine.optimizer), method
