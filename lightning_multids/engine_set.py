"""The engines of one fit: built from ``configure_optimizers``, and what the strategy asks of them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
from deepspeed import DeepSpeedEngine
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _configure_schedulers_manual_opt,
    _validate_optimizers_attached,
    _validate_scheduler_api,
)
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_multids import backward as routing
from lightning_multids.config import engine_config, frozen_config, merge
from lightning_multids.data import per_process_batch_size, train_loaders
from lightning_multids.discovery import reached_engines
from lightning_multids.engines import (
    attach,
    build_engine,
    build_frozen_engine,
    detach,
    is_partitioned,
    match_optimizers,
    unpartition,
)
from lightning_multids.optimizer import EngineOptimizer, EngineScheduler
from lightning_multids.sync import full_gradients, is_deferred, set_gradient_clipping


@dataclass
class EngineSet:
    """The engines of a LightningModule, the optimizers Lightning sees for them, and their bookkeeping."""

    engines: dict[str, DeepSpeedEngine] = field(default_factory=dict)
    optimizers: list[EngineOptimizer] = field(default_factory=list)
    scheduler_configs: list[LRSchedulerConfig] = field(default_factory=list)
    owners: dict[int, str] = field(default_factory=dict)
    """``id(parameter) -> engine name`` for the parameters of every trainable engine."""
    backward_calls: int = 0
    switched_to_manual: bool = False
    """Whether the strategy, not the user, put the module in manual optimization (several trainable engines)."""
    handles: dict[str, list[RemovableHandle]] = field(default_factory=dict)
    """The hooks the strategy registered for each engine, removed by :meth:`release`."""

    def add_frozen(self, name: str, engine: DeepSpeedEngine) -> None:
        """Record a frozen (inference) engine."""
        self.engines[name] = engine
        self.handles[name] = attach(name, engine)

    def add_trainable(
        self, name: str, engine: DeepSpeedEngine, optimizer: Optimizer, params: list[list[torch.nn.Parameter]]
    ) -> None:
        """Record a trainable engine, its optimizer for Lightning, and the parameters a backward can reach."""
        self.add_frozen(name, engine)
        self.handles[name] += routing.watch_gradients(name, engine)
        self.optimizers.append(EngineOptimizer(name, engine, optimizer, params))
        self.owners.update({id(p): name for p in engine.module.parameters()})

    def clip_by_default(
        self, clip: float | None, default: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Clip with ``Trainer(gradient_clip_val=clip)`` every trainable engine whose config sets no clipping.

        For manual optimization: Lightning then never calls ``configure_gradient_clipping``, so the engines
        clip in every ``step()`` themselves. (In automatic optimization Lightning's hook clips per step.)
        """
        if not clip:
            return
        for optimizer in self.optimizers:
            if "gradient_clipping" not in merge(default, overrides.get(optimizer.name, {})):
                set_gradient_clipping(optimizer.engine, float(clip))

    def release(self) -> None:
        """Remove every hook and patch the strategy added, destroy the engines and forget them; no collective.

        ``self.optimizers()`` keeps answering for the parameter groups (learning rates) after fit, as
        under DDP, but can no longer step.
        """
        for optimizer in self.optimizers:
            optimizer.release()
        for name, engine in self.engines.items():
            detach(engine, self.handles.get(name, []))
        self.engines.clear()
        self.handles.clear()
        self.owners.clear()

    @property
    def trainable_engines(self) -> dict[str, DeepSpeedEngine]:
        """The live trainable engines by name, in optimizer order (none after :meth:`release`)."""
        return {o.name: self.engines[o.name] for o in self.optimizers if o.name in self.engines}

    def clear_gradients(self) -> None:
        """Clear every trainable engine's gradients, as ``opt.zero_grad()`` on each would."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def full_gradients(self, name: str) -> dict[str, torch.Tensor]:
        """Engine ``name``'s whole gradients, averaged over ranks: :func:`lightning_multids.sync.full_gradients`."""
        trainable = self.trainable_engines
        if name not in trainable:
            raise ValueError(
                f"`full_gradients({name!r})`: there is no trainable engine {name!r} now. Trainable engines exist "
                f"during fit: {sorted(o.name for o in self.optimizers)}."
            )
        return full_gradients(trainable[name], name)

    def frozen_names(self) -> set[str]:
        """The names of the frozen (optimizer-less) engines."""
        return set(self.engines) - {optimizer.name for optimizer in self.optimizers}

    @contextmanager
    def backward(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Route the body's backward of the yielded (loss-scaled) tensor through every engine ``loss`` reaches.

        Raises if ``loss`` reaches no trainable engine (it would train nothing): before the backward when
        the graph shows everything, after it when a reentrant checkpoint hid part of the graph. An exception
        in the backward leaves the engines it reached clean, without their gradients of this step.
        """
        reach = reached_engines(loss, self.owners)
        if not reach.names and not reach.hidden:
            self._refuse_untrained()
        trainable = self.trainable_engines
        # fp16 engines: each sees its own loss scale; behind a hidden part any engine may be reached
        scaled = trainable if reach.hidden else {name: trainable[name] for name in reach.names}
        scale, factors = routing.loss_scaling(scaled)
        with routing.routed(loss, trainable, reach) as route, routing.gradients_rescaled(scaled, factors):
            try:
                yield loss * scale if scale != 1.0 else loss
            except BaseException:
                self._mark_gradients(route.entered, False)  # routed() drops them
                raise
        if not route.entered:
            self._refuse_untrained()
        self.backward_calls += 1
        self._mark_gradients(route.entered, True)

    def _mark_gradients(self, names: Collection[str], present: bool) -> None:
        for optimizer in self.optimizers:
            if optimizer.name in names:
                optimizer.has_gradients = present

    def _refuse_untrained(self) -> None:
        trainable = ", ".join(repr(o.name) for o in self.optimizers)
        raise ValueError(
            f"`manual_backward` got a loss that reaches no trainable engine ({trainable}): it would train "
            "nothing. Compute the loss from the outputs of those submodules without `.detach()` or "
            "`torch.no_grad()`, and check that `toggle_optimizer` has not turned off the gradients of the engine "
            "you mean to train."
        )

    def trainable(self, names: tuple[str, ...], *, what: str) -> dict[str, DeepSpeedEngine]:
        """The trainable engines called ``names`` (all of them when empty); ``what`` names the caller in errors."""
        trainable = [optimizer.name for optimizer in self.optimizers]
        if not trainable:
            raise RuntimeError(f"`{what}` needs the engines, which exist only during `Trainer.fit`.")
        unknown = [name for name in names if name not in trainable]
        if unknown:
            frozen = sorted(set(unknown) & self.frozen_names())
            reason = f" ({frozen} are frozen: they have no gradients to reduce)" if frozen else ""
            raise ValueError(
                f"`{what}` got {unknown}, which are not trainable engines{reason}. Choose from {trainable}."
            )
        chosen = {name: self.engines[name] for name in names or trainable}
        nested = [name for name, engine in chosen.items() if is_deferred(engine)]
        if nested:
            raise RuntimeError(f"`{what}`: the engines {nested} are already inside `no_sync`; don't nest the blocks.")
        return chosen

    def check_loss_was_used(self, output: Any) -> None:
        """Raise where it is certain that a module will never train: written for automatic optimization.

        Lightning allows a manual ``training_step`` to return a loss it did not backpropagate (it detaches
        it). Only a module that the strategy switched to manual optimization (the user wrote it for the
        automatic loop), that returns a loss needing gradients, and that has not called
        ``self.manual_backward`` once in this fit, is refused.
        """
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not self.switched_to_manual or self.backward_calls or not isinstance(loss, torch.Tensor):
            return
        if loss.requires_grad:
            raise ValueError(
                f"`training_step` returned a loss but called no `self.manual_backward`, so nothing trained. With "
                f"{len(self.optimizers)} trainable engines ({', '.join(repr(o.name) for o in self.optimizers)}) the "
                "LightningModule runs "
                "manual optimization: in `training_step`, call `self.manual_backward(loss)` and then `opt.step()` "
                "and `opt.zero_grad()` for each optimizer from `self.optimizers()`."
            )

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` with every ZeRO-3 partition gathered; a collective call (also after fit)."""
        partitioned = [param for param in module.parameters() if hasattr(param, "ds_id")]
        if not partitioned:
            return module.state_dict()
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            return {key: value.detach().clone() for key, value in module.state_dict().items()}


def build_engines(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    *,
    stage: int,
    default: Mapping[str, Any],
    overrides: Mapping[str, Mapping[str, Any]],
    precision: str,
    device_type: str = "cpu",
    agree: Callable[[BaseException | None], None] = lambda error: None,
) -> EngineSet:
    """Build the engines of ``module``: trainable ones first, in ``self.optimizers()`` order, then frozen ones.

    * an optimizer from ``configure_optimizers`` trains the submodule that owns its parameters;
    * a submodule named in ``engines`` whose DeepSpeed config has an ``optimizer`` section is trained by that
      optimizer (and the config's ``scheduler``); these come after the ``configure_optimizers`` ones;
    * any other submodule named in ``engines`` becomes a frozen (inference) engine;
    * submodules with neither an optimizer nor an entry stay plain modules on the device.

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
                device_type=device_type,
            )
            for name in {*overrides, *(name for name, _ in module.named_children())}
        }
        for name in configs:
            check_batch_settings(name, merge(default, overrides.get(name, {})), loader_batch, trainer.world_size)
    _unpartition_children(module, keep=lambda name: _stage(configs[name]) == 3)
    with _agreed(agree):
        plan = _plan(trainer, module, configs, overrides)
    result = EngineSet()
    _build_trainable(result, module, plan, configs)
    for name, config in plan.frozen.items():
        result.add_frozen(name, build_frozen_engine(getattr(module, name), config))
    _unpartition_children(module, keep=lambda name: name in result.engines)  # plain submodules stay whole
    return result


def build_evaluation_engines(
    module: pl.LightningModule,
    *,
    default: Mapping[str, Any],
    overrides: Mapping[str, Mapping[str, Any]],
    precision: str,
    device_type: str = "cpu",
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
                name, stage=3, default=default, override=override, precision=precision, device_type=device_type
            )
            result.add_frozen(name, build_engine(child, frozen_config(name, config, {})))
    return result


@dataclass
class _Plan:
    """What ``configure_optimizers`` and the configs decide, before any engine exists."""

    optimizers: list[Optimizer]
    scheduler_configs: list[LRSchedulerConfig]
    matched: dict[str, int]
    from_config: list[str]
    frozen: dict[str, dict[str, Any]]
    manual: bool
    switched: bool


def _plan(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    configs: Mapping[str, dict[str, Any]],
    overrides: Mapping[str, Mapping[str, Any]],
) -> _Plan:
    from_config = [name for name in overrides if "optimizer" in configs[name]]
    automatic = module.automatic_optimization
    optimizers, scheduler_configs = collect_optimizers(trainer, module, len(from_config))
    matched = match_optimizers(module, optimizers)
    for name in matched:
        _check_one_optimizer(name, configs[name])
    frozen = {
        name: frozen_config(name, configs[name], overrides[name])
        for name in overrides
        if name not in matched and name not in from_config
    }
    manual = not module.automatic_optimization
    return _Plan(optimizers, scheduler_configs, matched, from_config, frozen, manual, switched=automatic and manual)


def _build_trainable(
    result: EngineSet, module: pl.LightningModule, plan: _Plan, configs: Mapping[str, dict[str, Any]]
) -> None:
    for name, index in plan.matched.items():
        optimizer = plan.optimizers[index]
        params = [list(group["params"]) for group in optimizer.param_groups]
        engine = build_engine(getattr(module, name), configs[name], optimizer)
        result.add_trainable(name, engine, optimizer, params)
    # Schedulers from configure_optimizers stay the user's objects, in the user's order, stepped as under DDP:
    # by the user in manual optimization, by Lightning (interval, frequency, monitor) in automatic. They act on
    # the optimizer's param_group dicts, which DeepSpeed's optimizers (every stage, bf16) keep and read.
    result.scheduler_configs.extend(plan.scheduler_configs)
    for name in plan.from_config:
        trainable = [p for p in getattr(module, name).parameters() if p.requires_grad]
        engine = build_engine(getattr(module, name), configs[name])
        result.add_trainable(name, engine, engine.basic_optimizer, [trainable])
        if engine.lr_scheduler is not None:
            result.scheduler_configs.append(_config_scheduler(name, engine, plan.manual))
    for optimizer in result.optimizers:
        optimizer.manual = plan.manual
    result.switched_to_manual = plan.switched


@contextmanager
def _agreed(agree: Callable[[BaseException | None], None]) -> Iterator[None]:
    """Run local work, then tell ``agree`` whether it failed (``agree`` raises if any rank's did)."""
    try:
        yield
    except Exception as error:
        agree(error)
        raise
    agree(None)


def _stage(config: Mapping[str, Any]) -> int:
    return int(config["zero_optimization"].get("stage", 0))


def _unpartition_children(module: pl.LightningModule, keep: Callable[[str], bool]) -> None:
    """Make whole again the submodules ``configure_model`` built under ``zero.Init`` that ``keep`` rejects.

    Every rank reaches the same decisions, so the collective gathers line up.
    """
    for name, child in module.named_children():
        if is_partitioned(child) and not keep(name):
            unpartition(child)


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


def collect_optimizers(
    trainer: pl.Trainer, module: pl.LightningModule, num_config_optimizers: int = 0
) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """Call ``configure_optimizers``; with several trainable engines, switch the module to manual optimization.

    Args:
        trainer: the Trainer.
        module: the LightningModule.
        num_config_optimizers: how many engines get their optimizer from their DeepSpeed config.
    """
    conf = call._call_lightning_module_hook(trainer, "configure_optimizers", pl_module=module)
    if conf is None and not num_config_optimizers:
        raise ValueError(
            f"`{type(module).__name__}.configure_optimizers` returned None, so no engine would train. Return one "
            "optimizer per submodule to train, e.g. `[Adam(self.generator.parameters()), "
            "Adam(self.discriminator.parameters())]`, or give an engine an `optimizer` section in its DeepSpeed config."
        )
    optimizers, schedulers, monitor = _configure_optimizers(conf) if conf is not None else ([], [], None)
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
            f"MultiDeepSpeedStrategy: {total} trainable engines, so `{type(module).__name__}` runs manual "
            "optimization: call `self.manual_backward(loss)` and `opt.step()` in `training_step`."
        )
    if module.automatic_optimization:
        configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    else:
        configs = _configure_schedulers_manual_opt(schedulers)
    _validate_optimizers_attached(optimizers, configs)
    _validate_scheduler_api(configs, module)
    return optimizers, configs


def _refuse_accumulation_in_manual(trainer: pl.Trainer, module: pl.LightningModule, total: int) -> None:
    """Lightning refuses ``accumulate_grad_batches`` in manual optimization before setup; the switch comes later."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})`: `{type(module).__name__}` has "
            f"{total} trainable engines, so it runs manual optimization, where Lightning does not accumulate "
            "gradients. Remove the setting and accumulate in `training_step` (call `self.manual_backward(loss / N)` "
            "for N batches, then `opt.step()` and `opt.zero_grad()`), or train one engine."
        )


def _check_one_optimizer(name: str, config: Mapping[str, Any]) -> None:
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise ValueError(
                f"The engine {name!r} gets an optimizer from `configure_optimizers` and its DeepSpeed config has an "
                f"`{key}` section too. An engine has one optimizer: remove the `{key}` section from its config, or "
                f"stop returning an optimizer over `self.{name}.parameters()`."
            )


def _config_scheduler(name: str, engine: DeepSpeedEngine, manual: bool) -> LRSchedulerConfig:
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
