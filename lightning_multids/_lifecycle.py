"""The engines' lifecycle: built at setup, released at teardown, each step undone in reverse.

Setup (:func:`build_engines`, fit; :func:`build_evaluation_engines`, validate/test/predict):

1. plan from ``configure_optimizers`` and the configs (:mod:`lightning_multids._planning`);
2. make whole the submodules ``configure_model`` built under ``zero.Init`` whose engine is not ZeRO-3;
3. per engine: ``deepspeed.initialize`` (:func:`build_engine`), then :func:`attach` (the input cast, the
   refusal of ``engine(x)``) and, for a trainable engine, the router's gradient hooks.

Teardown (:func:`release_engines`) undoes 3 in reverse for every engine: the strategy's hooks, the frozen
engine's ``train`` patch, then the engine itself (:func:`~lightning_multids._compat.deepspeed.release_engine`).
No collective runs there, so it is safe after an exception on one rank.

An engine is keyed by the attribute name of its submodule on the LightningModule (``"generator"``).
The submodule stays where it is: ``self.generator`` is still the user's module, with all its
methods and attributes, and ``engine.module is self.generator``. DeepSpeed converts it in place
(device, dtype, ZeRO-3 partitioning, ZeRO-3 gather/release hooks).
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.utils import is_zero_param
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_multids._blocks import refuse_partitioned_use
from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat import torch as torch_compat
from lightning_multids._compat.lightning import sync_module_states
from lightning_multids._config import (
    check_accumulation_dtype,
    engine_config,
    frozen_config,
    merge,
    sized_buckets,
    zero_stage,
)
from lightning_multids._data import per_process_batch_size, train_loaders
from lightning_multids._ema import Average, build_averager, check_averages
from lightning_multids._engines import EngineSet
from lightning_multids._joined import called_modules, part_names
from lightning_multids._planning import Plan, check_batch_settings, config_scheduler, plan_engines
from lightning_multids._precision import autocast_off, cast_inputs, engine_dtype
from lightning_multids._routing import Router
from lightning_multids._zero_grad import route_module_zero_grad

CPU = torch.device("cpu")


def build_engines(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    *,
    stage: int,
    default: Mapping[str, Any],
    overrides: Mapping[str, Mapping[str, Any]],
    precision: str,
    device: torch.device = CPU,
    agree: Callable[[BaseException | None], None] = lambda error: None,
    averages: Mapping[str, Average] | None = None,
    find_unused: bool = False,
    elementwise: Sequence[type[Optimizer]] = (),
) -> EngineSet:
    """Build the engines of ``module``: trainable ones first, in ``self.optimizers()`` order, then frozen ones.

    * an optimizer from ``configure_optimizers`` trains the submodule that owns its parameters;
    * a submodule named in ``engine_configs`` whose DeepSpeed config has an ``optimizer`` section is trained by that
      optimizer (and the config's ``scheduler``); these come after the ``configure_optimizers`` ones;
    * any other submodule named in ``engine_configs`` becomes a frozen (inference) engine;
    * submodules with neither an optimizer nor an entry stay plain modules on the device;
    * each of ``averages`` (which have an entry, so a frozen engine) starts as a copy of its source and follows
      its steps (:mod:`lightning_multids._ema`).

    User hooks and checks run locally first; ``agree(error_or_None)`` is then called on every rank, and must
    raise on every rank if any rank passed an error. DeepSpeed's first collective (a store barrier in
    ``new_group``) would otherwise wait 30 minutes for a rank that failed.
    """
    with _agreed(agree):
        loaders = train_loaders(trainer)
        loader_batch = per_process_batch_size(loaders) if loaders is not None else None
        micro = loader_batch or 1  # DeepSpeed's bookkeeping only: it never scales a gradient here
        configs = {
            name: engine_config(
                name,
                stage=stage,
                default=default,
                override=overrides.get(name, {}),
                precision=precision,
                micro_batch_size=micro,
                device_type=device.type,
            )
            for name in {*overrides, *(name for name, _ in module.named_children())}
        }
        for name in configs:
            check_batch_settings(name, merge(default, overrides.get(name, {})), loader_batch, trainer.world_size)
    _unpartition_children(module, keep=lambda name: zero_stage(configs[name]) == 3)
    with _agreed(agree):
        plan = plan_engines(trainer, module, configs, overrides, elementwise)
        for name in [*plan.matched, *plan.from_config]:
            check_accumulation_dtype(configs[name], f"the engine {name!r}")
        check_zero3_device(
            [n for n in [*plan.matched, *plan.from_config, *plan.frozen] if zero_stage(configs[n]) == 3], device
        )
        joined = {name: parts for name, m in plan.modules.items() if (parts := part_names(m)) is not None}
        check_averages(averages or {}, module, [*plan.matched, *plan.from_config], configs, joined)
        _check_joined_partitioning(joined, module, configs)
    held = {part for name, m in plan.modules.items() for part in part_names(m) or [name]}
    result = EngineSet(router=Router(find_unused))
    try:
        _build_trainable(result, module, plan, configs, device)
        result.handles.append(route_module_zero_grad(module, [optimizer.zero_grad for optimizer in result.optimizers]))
        for name, config in plan.frozen.items():
            _add_frozen(result, name, build_frozen_engine(plan.modules[name], config, device))
        _unpartition_children(module, keep=held.__contains__)  # plain submodules stay whole
        result.averager = build_averager(averages or {}, module)
        if result.averager is not None:
            for optimizer in result.optimizers:
                optimizer.after_step = result.averager.after_step
            result.averager.start()
    except BaseException:  # out of memory while building: the engines built come off the modules
        release_engines(result)
        raise
    return result


def build_evaluation_engines(
    module: pl.LightningModule,
    *,
    default: Mapping[str, Any],
    overrides: Mapping[str, Mapping[str, Any]],
    precision: str,
    device: torch.device = CPU,
) -> EngineSet:
    """For validate, test and predict: an inference engine for each submodule that ZeRO-3 holds partitioned.

    Such a submodule (built under ``zero.Init`` in ``configure_model``, or left partitioned by a fit) can
    only run its forward through ZeRO-3's gather/release hooks. Whole submodules stay plain modules.
    """
    result = EngineSet()
    for name, child in module.named_children():
        if is_partitioned(child):
            override = merge(overrides.get(name, {}), {"zero_optimization": {"stage": 3}})
            config = engine_config(
                name, stage=3, default=default, override=override, precision=precision, device_type=device.type
            )
            _add_frozen(result, name, build_engine(child, frozen_config(name, config, {}), device=device))
    return result


def _build_trainable(
    result: EngineSet,
    module: pl.LightningModule,
    plan: Plan,
    configs: Mapping[str, dict[str, Any]],
    device: torch.device,
) -> None:
    for name, index in plan.matched.items():
        optimizer = plan.optimizers[index]
        params = [list(group["params"]) for group in optimizer.param_groups]
        config = sized_buckets(configs[name], whole_numel(p for group in params for p in group))
        engine = build_engine(plan.modules[name], config, optimizer, device=device)
        _add_trainable(result, name, engine, optimizer, params)
    # Schedulers from configure_optimizers stay the user's objects, in the user's order, stepped as under DDP:
    # by the user in manual optimization, by Lightning (interval, frequency, monitor) in automatic. They act on
    # the optimizer's param_group dicts, which DeepSpeed's optimizers (every stage, bf16) keep and read.
    result.scheduler_configs.extend(plan.scheduler_configs)
    for name in plan.from_config:
        trainable = [p for p in plan.modules[name].parameters() if p.requires_grad]
        config = sized_buckets(configs[name], whole_numel(trainable))
        engine = build_engine(plan.modules[name], config, device=device)
        _add_trainable(result, name, engine, ds_compat.torch_optimizer(engine), [trainable])
        if engine.lr_scheduler is not None:
            result.scheduler_configs.append(config_scheduler(name, engine, plan.manual))
    for optimizer in result.optimizers:
        optimizer.manual = plan.manual
    result.switched_to_manual = plan.switched


def whole_numel(params: Iterable[nn.Parameter]) -> int:
    """The elements of ``params``, whole (a ZeRO-3 parameter built partitioned counts in full)."""
    return sum(ds_compat.whole_numel(param) for param in params)


def _add_frozen(result: EngineSet, name: str, engine: DeepSpeedEngine) -> None:
    with _released_on_error(engine) as handles:
        ds_compat.check_engine(name, engine)
        handles += attach(name, engine)
    result.add(name, engine, handles)


def _add_trainable(
    result: EngineSet, name: str, engine: DeepSpeedEngine, optimizer: Optimizer, params: list[list[nn.Parameter]]
) -> None:
    with _released_on_error(engine) as handles:
        ds_compat.check_engine(name, engine)
        ds_compat.undo_initial_step(engine)
        ds_compat.scalar_safe_clipping(engine)
        handles += attach(name, engine)
        handles += result.router.watch(name, engine)
    result.add_trainable(name, engine, optimizer, params, handles)


@contextmanager
def _released_on_error(engine: DeepSpeedEngine) -> Iterator[list[RemovableHandle]]:
    """Yield a list for the handles put on ``engine``; if the body raises, detach them and release the engine."""
    handles: list[RemovableHandle] = []
    try:
        yield handles
    except BaseException:
        detach(engine, handles)
        raise


def release_engines(engines: EngineSet) -> None:
    """Undo :func:`build_engines` or :func:`build_evaluation_engines` for every engine; no collective.

    Every hook and patch comes off the user's modules and optimizers and each engine is destroyed, so the engines
    no longer run. Their states stay as long as ``engines`` is referenced: enough for ``engine.save_checkpoint``
    (the strategy keeps a fit's engines for ``trainer.save_checkpoint`` after ``fit``). ``self.optimizers()`` keeps
    answering for the parameter groups (learning rates) after fit, as under DDP, but can no longer step.
    """
    for optimizer in engines.optimizers:
        optimizer.release()
    for record in engines.records.values():
        detach(record.engine, record.handles)
        record.handles = []
    for handle in engines.handles:
        handle.remove()
    engines.handles = []


def build_engine(
    module: nn.Module,
    config: dict[str, Any],
    optimizer: Optimizer | None = None,
    scheduler: Any = None,
    *,
    device: torch.device = CPU,
) -> DeepSpeedEngine:
    """Wrap ``module`` in a DeepSpeed engine on ``device`` with ``optimizer`` and ``scheduler`` (owned by the engine).

    DeepSpeed puts an engine on the device of index ``LOCAL_RANK`` unless told otherwise; Lightning's device is the
    ``LOCAL_RANK``-th of the Trainer's ``devices``, which is another one for ``devices=[1]`` or ``[2, 3]``. So
    DeepSpeed is given Lightning's device index, as Lightning's ``DeepSpeedStrategy`` gives it. Without
    ``optimizer``, DeepSpeed builds one from the config's ``optimizer`` section if it has one, over the module's
    trainable parameters. The engine steps its scheduler in ``engine.step()``. Where DeepSpeed
    fails halfway (out of memory), the hooks it had put on the module come off again; a ZeRO-3 module stays
    partitioned.
    """
    remove_hooks = torch_compat.hooks_added_from_now(module)
    try:
        with ds_compat.scalar_parameters_broadcast():
            engine, *_ = deepspeed.initialize(
                model=module,
                optimizer=optimizer,
                model_parameters=None if optimizer is not None else [p for p in module.parameters() if p.requires_grad],
                lr_scheduler=scheduler,
                config=config,
                dist_init_required=False,
                args=engine_arguments(device),
            )
    except BaseException:
        remove_hooks()
        ds_compat.forget_zero3_module_state(module)
        raise
    return engine


def zero3_on_device(device: torch.device) -> bool:
    """Whether ZeRO-3 would run on ``device``: DeepSpeed's ZeRO-3 puts some of its tensors on GPU ``LOCAL_RANK``.

    ``zero.Init`` chooses its device, and ZeRO-3's checks that the ranks gather the same parameters in the same order
    (its first steps) put their tensors, by ``LOCAL_RANK``, not by the engine's device.
    """
    return device.index is None or os.environ.get("LOCAL_RANK", "0") == str(device.index)


def check_zero3_device(names: list[str], device: torch.device) -> None:
    """Refuse ZeRO-3 engines ``names`` where ZeRO-3 would not run on ``device`` alone (:func:`zero3_on_device`)."""
    if names and not zero3_on_device(device):
        local = os.environ.get("LOCAL_RANK", "0")
        raise ValueError(
            f"The ZeRO-3 engine(s) {names} would run partly on GPU {local}: this process's device is {device} "
            f"(the Trainer's `devices` list), and DeepSpeed's ZeRO-3 places some of its tensors by the process's "
            f"local rank ({local}), whatever the engine's device. Choose the GPUs with CUDA_VISIBLE_DEVICES instead "
            f"of a list, e.g. `CUDA_VISIBLE_DEVICES=2,3` with `Trainer(devices=2)`, or give these engines ZeRO-0/1/2 "
            "in `engine_configs`, which run on the listed devices."
        )


def engine_arguments(device: torch.device) -> argparse.Namespace | None:
    """What ``deepspeed.initialize(args=...)`` gets for an engine on ``device``: its index, where it has one."""
    return None if device.index is None else argparse.Namespace(device_rank=device.index)


def attach(name: str, engine: DeepSpeedEngine) -> list[RemovableHandle]:
    """Add what the strategy needs around a built engine; return the handles that :func:`detach` removes.

    Floating-point inputs of the submodule are cast to the engine's dtype on entry, an fp32 engine runs with
    autocast off (the ``bf16-mixed`` steps' autocast is for what runs outside the engines), and calling the
    engine itself is refused (:func:`refuse_direct_calls`).
    """
    refuse_direct_calls(name, engine)
    dtype = engine_dtype(engine)
    called = called_modules(engine.module)  # an engine over several submodules: each part, called by user code
    handles = [part.register_forward_pre_hook(cast_inputs(dtype), with_kwargs=True) for part in called]
    if dtype == torch.float32:
        handles += [handle for part in called for handle in autocast_off(part, engine.device.type)]
    if engine.zero_optimization_partition_weights():
        handles += [
            module.register_load_state_dict_pre_hook(_refuse_partitioned_load(name))
            for module in engine.module.modules()
            if any(True for _ in module.parameters(recurse=False))
        ]
        ds_compat.refuse_second_order(engine, _refuse_second_order(name))
        handles += ds_compat.discover_external_parameters(engine, refuse_partitioned_use(name))
    return handles


def _refuse_second_order(name: str) -> Callable[[], None]:
    """What a backward with ``create_graph=True`` into ZeRO-3 engine ``name`` meets (``ds_compat.refuse_second_order``).

    ``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty) records, for a second backward, operations
    that use the engine's weights; ZeRO-3 gathers them only around the engine's own forward and backward and
    partitions them (empties them) right after, so the second backward would meet empty weights. Refused as that
    first backward enters any submodule of the engine, however the submodule was called. Where the gradient stops at
    the engine's output (the output is itself the ``inputs`` of ``autograd.grad``), nothing enters the engine.
    """

    def refuse() -> None:
        raise ValueError(
            f"A backward with `create_graph=True` (a gradient penalty, `torch.autograd.grad(..., "
            f"create_graph=True)`, or a `torch.func` transform, which always records one) runs through engine "
            f"{name!r} (ZeRO-3): the graph it records for the second backward uses the weights of {name!r}, which "
            f"ZeRO-3 partitions again (empties) as soon as this backward leaves the engine, so that second backward "
            f"would fail or be wrong. Give {name!r}, and every engine the penalty runs through, ZeRO-0/1/2: "
            f"`engine_configs={{{name!r}: "
            '{"zero_optimization": {"stage": 2}}}`.'
        )

    return refuse


def _refuse_partitioned_load(name: str) -> Callable[..., None]:
    """A ``load_state_dict`` pre-hook of a ZeRO-3 engine's submodule: refuse whole weights into empty partitions.

    Torch would refuse them too, with a size mismatch against ``torch.Size([0])`` that says nothing of why; the
    strategy's own loads, and DeepSpeed's, load into gathered parameters or load empty ones, and pass.
    """

    def hook(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        for key, param in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor) and value.numel() and not param.data.numel() and is_zero_param(param):
                raise RuntimeError(
                    f"`load_state_dict` into the ZeRO-3 engine {name!r} outside `strategy.gathered({name!r}, "
                    f"modifier_rank=0)`: between forwards each of its parameters is an empty partition ({prefix}{key} "
                    f"holds none of its {value.numel()} elements here), so nothing can be loaded into it. Load inside "
                    f"the block, on every rank: `with self.trainer.strategy.gathered({name!r}, modifier_rank=0) as "
                    "module: module.load_state_dict(state)`; rank 0's weights then become every rank's and the "
                    "optimizer's."
                )

    return hook


def detach(engine: DeepSpeedEngine, handles: Iterable[RemovableHandle]) -> None:
    """Undo :func:`attach`, the router's hooks (in ``handles``) and the frozen eval patch; release the engine.

    The engine goes through :func:`~lightning_multids._compat.deepspeed.release_engine`.

    A ZeRO-3 submodule stays partitioned:
    ``deepspeed.zero.GatheredParameters`` reads it, and the next fit or evaluation builds an engine on it.
    A whole submodule of a bf16/fp16 engine goes back to torch's default dtype, on the CPU, where the teardown that
    calls this moves the module next: a blocking copy to the host converts there, so the accelerator never holds the
    submodule in fp32 (twice its bf16 size) at the end of a fit, which a model that fit only in bf16 would not
    survive.
    """
    for handle in handles:
        handle.remove()
    engine.module.__dict__.pop("train", None)
    ds_compat.release_engine(engine)
    if engine_dtype(engine) != torch.float32 and not is_partitioned(engine.module):
        # Without the input cast, a bf16/fp16 module would fail on fp32 inputs outside fit. Back in fp32 it runs
        # as under DDP with mixed precision; a ZeRO-3 one gets an engine (and its cast) again when evaluated.
        engine.module.to(device="cpu", dtype=torch.get_default_dtype())


def build_frozen_engine(module: nn.Module, config: dict[str, Any], device: torch.device = CPU) -> DeepSpeedEngine:
    """Wrap ``module`` in an inference engine: no gradients, no optimizer, always in eval mode.

    ``Trainer.fit`` puts the LightningModule in train mode at every epoch; the frozen submodule ignores it
    until :func:`detach`.
    """
    module.requires_grad_(False)
    module.eval()
    module.train = types.MethodType(_stay_in_eval, module)  # type: ignore[method-assign]
    return build_engine(module, config, device=device)


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def refuse_direct_calls(name: str, engine: DeepSpeedEngine) -> None:
    """Make calling the engine itself (``engine(x)``) an error that points to the submodule.

    ``DeepSpeedEngine.forward`` registers DeepSpeed's own backward hooks on the outputs, which run a
    second prologue beside the strategy's routing and leave the engine's backward state broken.
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"The DeepSpeed engine {name!r} was called directly. Call the submodule instead (`self.{name}(x)` in "
            "the LightningModule): MultiDeepSpeedStrategy routes each backward through the engines itself, and "
            "`engine(x)` would add DeepSpeed's own backward hooks beside it."
        )

    engine.forward = forward  # type: ignore[method-assign]


def agree_on_failure(error: BaseException | None, *, world_size: int, rank: int, device: torch.device) -> None:
    """Tell every rank whether any rank failed; raise on the ranks that did not (the failed one re-raises).

    A collective call, made by every rank at the same point of setup whether its own work failed or not.
    """
    if world_size == 1 or not torch.distributed.is_initialized():
        return
    failed = torch.zeros(world_size, device=device)
    failed[rank] = float(error is not None)
    torch.distributed.all_reduce(failed)
    ranks = [index for index, flag in enumerate(failed.tolist()) if flag]
    if ranks and error is None:
        raise RuntimeError(
            f"MultiDeepSpeedStrategy: rank(s) {ranks} failed while setting up the engines (their output says why); "
            f"rank {rank} stops too instead of waiting for them."
        )


@contextmanager
def _agreed(agree: Callable[[BaseException | None], None]) -> Iterator[None]:
    """Run local work, then tell ``agree`` whether it failed (``agree`` raises if any rank's did)."""
    try:
        yield
    except Exception as error:
        agree(error)
        raise
    agree(None)


def _check_joined_partitioning(
    joined: Mapping[str, Sequence[str]], module: nn.Module, configs: Mapping[str, Mapping[str, Any]]
) -> None:
    """Refuse a part built partitioned (``zero.Init`` in ``configure_model``) of a joined engine that is not ZeRO-3.

    Whether such a submodule is made whole is decided from its own config before ``configure_optimizers`` says
    which submodules train together (an optimizer must hold the parameters as they will stay).
    """
    for name, parts in joined.items():
        stage = zero_stage(configs[name])
        built = [part for part in parts if is_partitioned(getattr(module, part))]
        if stage != 3 and built:
            raise ValueError(
                f"The engine {name!r} (one optimizer over {', '.join(repr(p) for p in parts)}) runs ZeRO-{stage}, but "
                f"{built} were built partitioned under `zero.Init` (`configure_model`), by the ZeRO-3 of their own "
                f"config. Give the engine's parts one stage: key the stage in the `engine_configs` entry {name!r} and "
                "in the strategy's `stage=` alike, or build them in `__init__`."
            )


def _unpartition_children(module: pl.LightningModule, keep: Callable[[str], bool]) -> None:
    """Make whole again the submodules ``configure_model`` built under ``zero.Init`` that ``keep`` rejects.

    Every rank reaches the same decisions, so the collective gathers line up. A submodule that shares a
    partitioned parameter with one that stays partitioned is refused: made whole, it would hold a copy.
    """
    kept = {p: name for name, child in module.named_children() if keep(name) for p in child.parameters()}
    for name, child in module.named_children():
        if is_partitioned(child) and not keep(name):
            holder = next((kept[p] for p in child.parameters() if p in kept), None)
            if holder is not None:
                raise ValueError(
                    f"The submodule {name!r} shares a parameter with the ZeRO-3 submodule {holder!r} (built under "
                    f"`zero.Init` in `configure_model`), and is not ZeRO-3 itself: made whole, {name!r} would run on "
                    f"a copy that does not train. Give both the same stage in `engine_configs`, or call the shared "
                    f"layer through `self.{holder}` in the forward."
                )
            unpartition(child)


@contextmanager
def zero3_init(config: dict[str, Any]) -> Iterator[None]:
    """A ``deepspeed.zero.Init`` context: modules built inside it are partitioned as they are created."""
    with (
        ds_compat.scalar_parameters_broadcast(),
        deepspeed.zero.Init(config_dict_or_path=config, mem_efficient_linear=False),
    ):
        yield


def is_partitioned(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters partitioned by ZeRO-3 (built under ``zero.Init``)."""
    return any(is_zero_param(param) for param in module.parameters())


def unpartition(module: nn.Module) -> None:
    """Replace the ZeRO-3-partitioned parameters of ``module`` by whole, ordinary ones (a collective call).

    Used for submodules built under ``zero.Init`` in ``configure_model`` whose engine is not ZeRO-3.
    The parameter objects change, so this must run before an optimizer holds them. A parameter shared
    by several modules (tied weights) becomes one whole parameter, still shared. Floating-point ones get
    torch's default dtype, as if built without ``zero.Init`` (whose dtype is the ZeRO-3 engines').
    """
    partitioned = [param for param in module.parameters() if is_zero_param(param)]
    dtype = torch.get_default_dtype()  # what it would have been built in without zero.Init; its engine casts
    whole: dict[nn.Parameter, nn.Parameter] = {}
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        for child in module.modules():
            for name, param in list(child.named_parameters(recurse=False, remove_duplicate=False)):
                if is_zero_param(param):
                    if param not in whole:
                        data = param.data.to(dtype) if param.is_floating_point() else param.data
                        whole[param] = nn.Parameter(data.clone(), requires_grad=param.requires_grad)
                    setattr(child, name, whole[param])


def sync_replicated_states(module: nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers to every rank, as DDP does outside fit; a collective call.

    Lightning's own ``_sync_module_states``, which honours ``module._ddp_params_and_buffers_to_ignore``. A ZeRO-3
    parameter holds an empty tensor outside a gather (its partition lives beside it), so broadcasting it changes
    nothing: each rank keeps its own partition.
    """
    if torch.distributed.is_initialized():
        sync_module_states(module)
