"""Planning at setup, before any engine exists: which engines to build, and what the user's code asks of them.

``configure_optimizers`` is called once (:func:`collect_optimizers`); a module with several trainable
engines is switched to manual optimization. The configs decide which submodules get a frozen engine.
Settings that cannot work are refused here, and user hooks that would misread ZeRO's gradients are warned.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.optim import Optimizer

from lightning_multids._compat.lightning import (
    call_configure_optimizers,
    optimizers_and_schedulers,
    refuse_optimizer_idx,
    scheduler_configs,
)
from lightning_multids._compat.torch import is_compiled
from lightning_multids._config import frozen_config, zero_stage
from lightning_multids._discovery import match_parts
from lightning_multids._joined import Joined, called_modules
from lightning_multids._optimizer import EngineScheduler


@dataclass
class Plan:
    """What ``configure_optimizers`` and the configs decide, before any engine exists."""

    optimizers: list[Optimizer]
    scheduler_configs: list[LRSchedulerConfig]
    matched: dict[str, int]
    modules: dict[str, nn.Module]
    """Each engine's module: its submodule, or for an optimizer over several submodules a
    :class:`~lightning_multids._joined.Joined` container of them (the engine named by its first part)."""
    from_config: list[str]
    frozen: dict[str, dict[str, Any]]
    manual: bool
    switched: bool


ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    FusedAdam,
    FusedLion,
    DeepSpeedCPUAdam,
    DeepSpeedCPUAdagrad,
    DeepSpeedCPULion,
)
"""Optimizers that update each element of a parameter from that element alone (its gradient, its state, the step
count): over ZeRO-1/2/3's flat partitions they give ``torch.optim``'s result. A subclass counts where it keeps
its base's ``step``."""


def plan_engines(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    configs: Mapping[str, dict[str, Any]],
    overrides: Mapping[str, Mapping[str, Any]],
    elementwise: Sequence[type[Optimizer]] = (),
) -> Plan:
    """Decide, from ``configure_optimizers`` and the resolved ``configs``, which engines to build and how.

    ``elementwise``: the optimizer classes the user declared element-wise, beside :data:`ELEMENTWISE_OPTIMIZERS`.
    """
    from_config = [name for name in overrides if "optimizer" in configs[name]]
    automatic = module.automatic_optimization
    optimizers, scheduler_configs = collect_optimizers(trainer, module, len(from_config))
    parts = match_parts(module, optimizers)
    matched = {names[0]: index for index, names in enumerate(parts)}
    _check_part_entries(parts, overrides, module, optimizers)
    modules = {name: getattr(module, name) for name in module_names(module, overrides)}
    modules.update({names[0]: _engine_module(module, names) for names in parts})
    for name, index in matched.items():
        _check_one_optimizer(name, configs[name])
        _check_offloaded_optimizer(name, configs[name], optimizers[index])
        _check_steps_without_closure(name, optimizers[index])
        _check_elementwise(name, configs[name], optimizers[index], (*ELEMENTWISE_OPTIMIZERS, *elementwise))
    for name in from_config:
        _check_config_optimizer(name, configs[name], (*ELEMENTWISE_OPTIMIZERS, *elementwise))
    frozen = {
        name: frozen_config(name, configs[name], overrides[name])
        for name in overrides
        if name not in matched and name not in from_config
    }
    for name in frozen:
        _check_has_parameters(name, modules[name])
    for name in [*matched, *from_config, *frozen]:
        for part in called_modules(modules[name]):
            _check_not_compiled_at_zero3(name, part, configs[name])
            _check_parameters_take_recurse(name, part, configs[name])
    engines = {name: modules[name] for name in [*matched, *from_config, *frozen]}
    check_disjoint(module, engines, configs)
    manual = not module.automatic_optimization
    return Plan(
        optimizers, scheduler_configs, matched, engines, from_config, frozen, manual, switched=automatic and manual
    )


def module_names(module: nn.Module, overrides: Mapping[str, Any]) -> list[str]:
    """The names of ``overrides`` that are submodules of ``module`` (an EMA's entry may name one not made yet)."""
    children = dict(module.named_children())
    return [name for name in overrides if name in children]


def _engine_module(module: nn.Module, parts: Sequence[str]) -> nn.Module:
    """The module of the engine over ``parts``: the submodule itself, or a container of several (not an attribute)."""
    if len(parts) == 1:
        return getattr(module, parts[0])
    return Joined({part: getattr(module, part) for part in parts})


def _check_part_entries(
    parts: Sequence[tuple[str, ...]], overrides: Mapping[str, Any], module: nn.Module, optimizers: Sequence[Optimizer]
) -> None:
    """Refuse an ``engine_configs`` entry for a submodule that is a later part of an engine over several."""
    for names, optimizer in zip(parts, optimizers, strict=False):
        for part in names[1:]:
            if part in overrides:
                listed = ", ".join(repr(name) for name in names)
                raise ValueError(
                    f"`engine_configs` has an entry for {part!r}, which one optimizer trains with {listed}: they form "
                    f"one DeepSpeed engine, named {names[0]!r} (its first part), with one config."
                    f"{_through_shared(names, module, optimizer)} Key the entry {names[0]!r} (merge the entries of "
                    f"its parts there), or give {part!r} an optimizer of its own in `configure_optimizers` for an "
                    "engine of its own."
                )


def _through_shared(names: Sequence[str], module: nn.Module, optimizer: Optimizer) -> str:
    """Where a part is in the optimizer only through parameters another part shares with it, a sentence saying so."""
    stepped = {param for group in optimizer.param_groups for param in group["params"]}
    held = {name: set(getattr(module, name).parameters()) & stepped for name in names}
    for name in names:
        others = set().union(*(params for other, params in held.items() if other != name))
        if held[name] <= others:
            sharers = [other for other in names if other != name and held[other] & held[name]]
            verb = "shares" if len(sharers) == 1 else "share"
            return (
                f" {name!r} is in it only through parameters that {', '.join(repr(s) for s in sharers)} {verb} with "
                f"it (a layer they hold too): the optimizer trains that layer, as under DDP."
            )
    return ""


def collect_optimizers(
    trainer: pl.Trainer, module: pl.LightningModule, num_config_optimizers: int = 0
) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """Call ``configure_optimizers``; with several trainable engines, switch the module to manual optimization.

    Args:
        trainer: the Trainer.
        module: the LightningModule.
        num_config_optimizers: how many engines get their optimizer from their DeepSpeed config.
    """
    conf = call_configure_optimizers(trainer, module)
    if conf is None and not num_config_optimizers:
        raise ValueError(
            f"`{type(module).__name__}.configure_optimizers` returned None, so no engine would train. Return one "
            "optimizer per submodule to train, e.g. `[Adam(self.generator.parameters()), "
            "Adam(self.discriminator.parameters())]`, or give an engine an `optimizer` section in its DeepSpeed config."
        )
    optimizers, schedulers, monitor = optimizers_and_schedulers(conf) if conf is not None else ([], [], None)
    refuse_optimizer_idx(module, optimizers)
    total = len(optimizers) + num_config_optimizers
    if total > 1 and module.automatic_optimization:
        _refuse_accumulation_in_manual(trainer, module, total)
        module.automatic_optimization = False
        if module.automatic_optimization:
            raise ValueError(
                f"`{type(module).__name__}` has {total} trainable engines but keeps `automatic_optimization` True. "
                "Lightning's automatic loop steps one optimizer; remove the `automatic_optimization` override "
                "(MultiDeepSpeedStrategy switches to manual optimization) and step each optimizer in `training_step`."
            )
        rank_zero_info(
            f"MultiDeepSpeedStrategy: `{type(module).__name__}` has {total} trainable engines, so it runs under "
            "manual optimization, where its `training_step` steps each optimizer and Lightning steps none."
        )
    return optimizers, scheduler_configs(schedulers, monitor, module, optimizers)


def _refuse_accumulation_in_manual(trainer: pl.Trainer, module: pl.LightningModule, total: int) -> None:
    """Lightning refuses ``accumulate_grad_batches`` in manual optimization before setup; the switch comes later."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})`: `{type(module).__name__}` has "
            f"{total} trainable engines, so it runs manual optimization, where Lightning does not accumulate "
            "gradients. Remove the setting and accumulate in `training_step` (call `self.manual_backward(loss / N)` "
            "for N batches, then `opt.step()` and `opt.zero_grad()`), or train one engine."
        )


def _check_steps_without_closure(name: str, optimizer: Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (``LBFGS``): DeepSpeed's engine steps it without one."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"The optimizer of engine {name!r} (`{type(optimizer).__module__}.{type(optimizer).__qualname__}`) needs a "
            "closure at every step (`opt.step(closure)`, which it calls again within the step); DeepSpeed's engine "
            f"steps its optimizer once, without a closure. Give {name!r} an optimizer that steps without one "
            "(`torch.optim.SGD`, `Adam`, `AdamW`, ...)."
        )


def optimizer_class(kind: type[Optimizer] | str) -> type[Optimizer]:
    """An optimizer class, or the class at an import path (``"my_package.MyAdam"``), checked."""
    found: Any = kind
    if isinstance(kind, str):
        module_name, _, attribute = kind.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(
                f"MultiDeepSpeedStrategy(elementwise_optimizers=[{kind!r}]): no class at that path ({error}). Give "
                'the class itself or its full import path, e.g. "my_package.optim.MyAdam".'
            ) from None
    if not (isinstance(found, type) and issubclass(found, Optimizer)):
        raise ValueError(
            f"MultiDeepSpeedStrategy(elementwise_optimizers=[{kind!r}]): {found!r} is not a `torch.optim.Optimizer` "
            "subclass. List optimizer classes (or their import paths), e.g. `[my_package.optim.MyAdam]`."
        )
    return found


def is_elementwise(kind: type[Optimizer], known: Sequence[type[Optimizer]]) -> bool:
    """Whether ``kind`` is one of ``known`` or a subclass that steps as its base does."""
    step = inspect.unwrap(kind.step)  # torch wraps a class's `step` when the first optimizer of it is made
    return any(issubclass(kind, base) and step is inspect.unwrap(base.step) for base in known)


def _check_elementwise(
    name: str, config: Mapping[str, Any], optimizer: Optimizer, known: Sequence[type[Optimizer]]
) -> None:
    """Refuse, at ZeRO-1/2/3, an optimizer not known to update each element from that element alone.

    There DeepSpeed steps the optimizer over flat partitions of the engine's parameters (one tensor per group and
    rank, cut anywhere), so an optimizer that treats each tensor as a whole (Adafactor's row and column factors,
    LAMB's and LARS's trust ratio per tensor, Muon's orthogonalised matrices, Shampoo's preconditioners) would
    silently compute something else. ZeRO-0 hands it the parameters as they are.
    """
    stage = zero_stage(config)
    kind = type(optimizer)
    if stage == 0 or is_elementwise(kind, known):
        return
    raise ValueError(_tensorwise_refusal(name, stage, f"`{kind.__module__}.{kind.__qualname__}`", kind))


def _check_config_optimizer(name: str, config: Mapping[str, Any], known: Sequence[type[Optimizer]]) -> None:
    """Refuse, at ZeRO-1/2/3, a DeepSpeed config's ``optimizer`` that is not element-wise (``"Adafactor"``, LAMB).

    DeepSpeed builds its own optimizers by name (Adam, AdamW, Adagrad, Lion, the mu-P ones: element-wise; its
    Muon, which keeps each matrix whole at ZeRO-1/2; LAMB, which does not) and any other from ``torch.optim``.
    """
    stage, kind = zero_stage(config), str(config["optimizer"].get("type", ""))
    if stage == 0:
        return
    if kind.lower() == "lamb":
        raise ValueError(_tensorwise_refusal(name, stage, f"DeepSpeed's {kind!r}", None))
    found = getattr(torch.optim, kind, None)
    if kind.lower() in DEEPSPEED_OPTIMIZERS or not isinstance(found, type) or is_elementwise(found, known):
        return
    raise ValueError(_tensorwise_refusal(name, stage, f"`torch.optim.{kind}` (its config's `optimizer`)", found))


def _tensorwise_refusal(name: str, stage: int, what: str, kind: type[Optimizer] | None) -> str:
    declare = ""
    if kind is not None:
        path = f"{kind.__module__}.{kind.__qualname__}"
        declare = (
            f"; or, if `{kind.__qualname__}` updates each element from that element's gradient and state alone, "
            f'declare it: `MultiDeepSpeedStrategy(elementwise_optimizers=["{path}"])`'
        )
    return (
        f"The engine {name!r} runs ZeRO-{stage}, where DeepSpeed steps its optimizer ({what}) over flat partitions "
        "of the engine's parameters, not over each parameter as `torch.optim` does. An optimizer that treats each "
        "tensor as a whole (Adafactor, LAMB, LARS, Muon, Shampoo) computes something else there, silently. Give "
        f"{name!r} ZeRO-0 (`engine_configs={{{name!r}: {{'zero_optimization': {{'stage': 0}}}}}}`), or an "
        f"element-wise optimizer (`torch.optim.SGD`, `Adam`, `AdamW`, ...){declare}."
    )


def _check_not_compiled_at_zero3(name: str, submodule: nn.Module, config: Mapping[str, Any]) -> None:
    """Refuse a ``torch.compile``d submodule at ZeRO-3: DeepSpeed's ZeRO-3 engine fails inside on one."""
    if zero_stage(config) == 3 and is_compiled(submodule):
        raise ValueError(
            f"The submodule {name!r} is a `torch.compile`d module and its engine runs ZeRO-3, which DeepSpeed does not "
            f"run on a compiled module (it fails inside DeepSpeed). Give {name!r} ZeRO-0/1/2, e.g. "
            f"`engine_configs={{{name!r}: {{'zero_optimization': {{'stage': 2}}}}}}`, or assign the module "
            "uncompiled."
        )


def _check_parameters_take_recurse(name: str, submodule: nn.Module, config: Mapping[str, Any]) -> None:
    """Refuse at ZeRO-3 a module whose ``parameters()`` override lacks ``recurse`` or leaves parameters out.

    DeepSpeed's ZeRO-3 calls ``module.parameters(recurse=...)`` on the engine's submodules as it partitions them: on
    an override without the argument (x-transformers' ``DPO``) it stops with Python's ``TypeError``, and where the
    override returns only some parameters (a policy's beside its reference) the others stay unpartitioned and it
    stops with an ``AttributeError`` inside DeepSpeed. Modules that keep torch's own method are not looked at.
    """
    if zero_stage(config) != 3:
        return
    for path, child in submodule.named_modules():
        if getattr(child.parameters, "__func__", None) is nn.Module.parameters:  # torch's own (also on the instance)
            continue
        try:
            inspect.signature(child.parameters).bind(recurse=True)
            complete = set(child.parameters(recurse=True)) >= {param for _, param in child.named_parameters()}
        except TypeError:
            complete = False
        if not complete:
            where = f"`{name}.{path}`" if path else f"{name!r}"
            raise ValueError(
                f"The submodule {where} ({type(child).__module__}.{type(child).__qualname__}) overrides "
                f"`parameters()` so that it does not take `recurse` or does not return all of its parameters, and "
                f"engine {name!r} runs ZeRO-3, which partitions what `module.parameters(recurse=...)` returns on "
                f"every submodule. Give {name!r} ZeRO-0/1/2, e.g. `engine_configs={{{name!r}: "
                "{'zero_optimization': {'stage': 2}}}` (an override that returns only some parameters, such as a "
                "policy's beside its reference, cannot run at ZeRO-3)."
            )


def _check_has_parameters(name: str, submodule: nn.Module) -> None:
    """Refuse a frozen engine for a submodule without parameters (DeepSpeed fails inside on one, at ZeRO-3)."""
    if next(submodule.parameters(), None) is None:
        raise ValueError(
            f"The submodule {name!r} has an `engine_configs` entry and no optimizer, so it would be a frozen engine, "
            "but it has no parameters for DeepSpeed to hold. Remove its entry: without one it runs as a plain "
            "submodule, as a parameterless module needs."
        )


def check_disjoint(
    module: nn.Module, engines: Mapping[str, nn.Module], configs: Mapping[str, Mapping[str, Any]]
) -> None:
    """Refuse a parameter shared by two engines, or by a plain submodule and a ZeRO-3 engine.

    An engine owns its parameters: a frozen one turns their gradients off, a ZeRO-3 one partitions them. A
    second owner would silently stop the shared layer training, run on a copy of it, or fail inside DeepSpeed.
    Plain submodules sharing with a ZeRO-0/1/2 engine are fine: the loss reaches that engine through them. So is a
    frozen layer (``requires_grad=False``) that engines at ZeRO-0/1/2 in one precision share (two heads on one
    frozen encoder): no engine partitions it, casts it apart, or turns anything off.
    """
    owner: dict[nn.Parameter, str] = {}
    for name, engine_module in engines.items():
        for param in engine_module.parameters():
            other = owner.setdefault(param, name)
            if other != name and not _may_share(param, configs[other], configs[name]):
                raise ValueError(
                    f"The engines {other!r} and {name!r} share a parameter. An engine owns its parameters (a frozen "
                    "one turns their gradients off, a ZeRO-3 one partitions them), so the shared layer would stop "
                    f"training or fail inside DeepSpeed. If {name!r} only reuses the layer, remove its "
                    "`engine_configs` entry (it then runs as a plain submodule); otherwise give it its own copy "
                    f"(`copy.deepcopy`). {_AVERAGE_ADVICE.format(source=other)}"
                )
    held = {id(part) for engine_module in engines.values() for part in called_modules(engine_module)}
    for name, child in module.named_children():
        if id(child) in held:
            continue
        for param in child.parameters():
            holder = owner.get(param)
            if holder is not None and zero_stage(configs[holder]) == 3:
                raise ValueError(
                    f"The plain submodule {name!r} shares a parameter with the ZeRO-3 engine {holder!r}, which "
                    f"partitions it: {name!r} would run on a copy that does not train. Give {holder!r} ZeRO-0/1/2 "
                    f"in `engine_configs`, or call the shared layer through `self.{holder}` in the forward. "
                    + _AVERAGE_ADVICE.format(source=holder)
                )


_AVERAGE_ADVICE = (
    "Where it keeps a moving average of {source!r} (ema-pytorch's `EMA` holds its source as `online_model`), keep "
    "the average with `MultiDeepSpeedStrategy(ema=...)` (docs/ema.md), which updates it at any ZeRO stage."
)

PRECISIONS = ("bf16", "fp16")


def _may_share(param: nn.Parameter, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    same_precision = all(bool(a.get(k, {}).get("enabled")) == bool(b.get(k, {}).get("enabled")) for k in PRECISIONS)
    return not param.requires_grad and zero_stage(a) != 3 and zero_stage(b) != 3 and same_precision


def _check_one_optimizer(name: str, config: Mapping[str, Any]) -> None:
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise ValueError(
                f"The engine {name!r} gets an optimizer from `configure_optimizers` and its DeepSpeed config has an "
                f"`{key}` section too. An engine has one optimizer: remove the `{key}` section from its config, or "
                f"stop returning an optimizer over `self.{name}.parameters()`."
            )


def _check_offloaded_optimizer(name: str, config: Mapping[str, Any], optimizer: Optimizer) -> None:
    """Refuse, naming the engine, what DeepSpeed refuses later: a torch optimizer stepping offloaded states."""
    device = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
    if device not in ("cpu", "nvme") or config.get("zero_force_ds_cpu_optimizer") is False:
        return
    if isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        return
    kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    raise ValueError(
        f"The engine {name!r} offloads its optimizer states (`zero_optimization.offload_optimizer.device: {device}`) "
        f"and `configure_optimizers` gives it `{kind}`, which DeepSpeed refuses there. Return "
        f"`deepspeed.ops.adam.DeepSpeedCPUAdam(self.{name}.parameters(), ...)` (DeepSpeed's vectorized CPU Adam), or "
        'set `"zero_force_ds_cpu_optimizer": false` in the engine\'s config to step this optimizer on the CPU as it is.'
    )


def check_batch_settings(name: str, config: Mapping[str, Any], loader_batch: int | None, world_size: int) -> None:
    """Raise if the engine's batch-size settings contradict the training dataloader.

    Gradient accumulation is owned by the loop here, so a DeepSpeed batch is one dataloader batch per
    process: ``train_micro_batch_size_per_gpu`` must equal it and ``train_batch_size`` be it times the ranks.
    """
    if loader_batch is None:
        return
    micro = config.get("train_micro_batch_size_per_gpu")
    total = config.get("train_batch_size")
    if micro is not None and micro != loader_batch:
        setting, expected = f"train_micro_batch_size_per_gpu={micro}", loader_batch
    elif total is not None and total != loader_batch * world_size:
        setting, expected = f"train_batch_size={total}", loader_batch * world_size
    else:
        return
    raise ValueError(
        f"The DeepSpeed config for the engine {name!r} sets {setting}, but the training dataloader gives "
        f"{loader_batch} samples per process on {world_size} processes ({expected} here). Remove the setting (it is "
        "derived from the dataloader) or change the dataloader's batch size."
    )


def config_scheduler(name: str, engine: DeepSpeedEngine, manual: bool) -> LRSchedulerConfig:
    """Show the scheduler of a DeepSpeed config's ``scheduler`` section to Lightning.

    In manual optimization the engine steps it in ``opt.step()`` and ``self.lr_schedulers()`` shows it
    wrapped so that a second ``step()`` is refused; in automatic optimization Lightning steps it per
    optimizer step, as it steps the others.
    """
    if manual:
        return LRSchedulerConfig(EngineScheduler(name, engine.lr_scheduler), interval="step")  # type: ignore[arg-type]
    config = LRSchedulerConfig(engine.lr_scheduler, interval="step")
    engine.lr_scheduler = None
    return config


def _overridden(module: pl.LightningModule, hook: str) -> bool:
    return getattr(type(module), hook) is not getattr(pl.LightningModule, hook)


def warn_clipping_overrides(module: pl.LightningModule, engines: Mapping[str, DeepSpeedEngine]) -> None:
    """Warn where an overridden ``configure_gradient_clipping`` would never be called, or could not clip by itself.

    A read of ``param.grad`` in a hook is refused at the read: ``_gradients.refuse_gradient_read``.

    Args:
        module: the LightningModule.
        engines: its trainable engines by name.
    """
    partitioned = sorted(name for name, e in engines.items() if e.zero_optimization_partition_gradients())
    name = type(module).__name__
    if not _overridden(module, "configure_gradient_clipping"):
        return
    if not module.automatic_optimization:
        rank_zero_warn(
            f"`{name}` overrides `configure_gradient_clipping`, which Lightning calls only in automatic optimization; "
            f"`{name}` runs manual optimization ({len(engines)} engines). Clip in `training_step` with "
            "`self.clip_gradients(opt, gradient_clip_val=...)` before `opt.step()`."
        )
    elif partitioned:
        rank_zero_warn(
            f"`{name}` overrides `configure_gradient_clipping`: only `self.clip_gradients(...)` calls in it take "
            f"effect (DeepSpeed clips inside `step()`); a read of `param.grad` there is refused, and it is None for "
            f"the ZeRO-2/3 engines {partitioned}."
        )


def check_clip_algorithm(trainer: pl.Trainer) -> None:
    """Refuse ``Trainer(gradient_clip_algorithm=...)`` other than norm: DeepSpeed clips by global norm only."""
    algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm or "norm"))
    if trainer.gradient_clip_val and algorithm != "norm":
        raise ValueError(
            f"`Trainer(gradient_clip_algorithm={algorithm!r})` is not available: DeepSpeed "
            "clips by global norm. Use `gradient_clip_algorithm='norm'`."
        )
