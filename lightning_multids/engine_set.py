"""The engines of one fit: built from ``configure_optimizers``, and what the strategy asks of them."""

from __future__ import annotations

import copy
from collections.abc import Mapping
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

from lightning_multids.backward import reached_engines
from lightning_multids.config import engine_config
from lightning_multids.engines import build_engine, match_optimizers, scheduler_for
from lightning_multids.optimizer import EngineOptimizer, EngineScheduler


@dataclass
class EngineSet:
    """The engines of a LightningModule, the optimizers Lightning sees for them, and their bookkeeping."""

    engines: dict[str, DeepSpeedEngine] = field(default_factory=dict)
    optimizers: list[EngineOptimizer] = field(default_factory=list)
    scheduler_configs: list[LRSchedulerConfig] = field(default_factory=list)
    owners: dict[int, str] = field(default_factory=dict)
    """``id(parameter) -> engine name`` for the parameters of every trainable engine."""
    backward_calls: int = 0

    def reached_by(self, loss: torch.Tensor) -> list[DeepSpeedEngine]:
        """The trainable engines ``loss`` reaches; raises if it reaches none (it would train nothing)."""
        names = reached_engines(loss, self.owners)
        if not names:
            raise ValueError(
                "`manual_backward` got a loss that reaches no trainable engine "
                f"({', '.join(repr(n) for n in self.engines)}): it would train nothing. Compute the loss from the "
                "outputs of those submodules without `.detach()` or `torch.no_grad()`, and check that "
                "`toggle_optimizer` has not turned off the gradients of the engine you mean to train."
            )
        self.backward_calls += 1
        for optimizer in self.optimizers:
            if optimizer.name in names:
                optimizer.has_gradients = True
        return [self.engines[name] for name in names]

    def check_loss_was_used(self, output: Any, backward_calls_before: int) -> None:
        """In manual optimization, raise if ``training_step`` returned a loss and nothing was backpropagated."""
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if self.backward_calls != backward_calls_before or not isinstance(loss, torch.Tensor):
            return
        if loss.requires_grad:
            raise ValueError(
                f"`training_step` returned a loss but called no `self.manual_backward`, so nothing trained. With "
                f"{len(self.engines)} engines ({', '.join(repr(n) for n in self.engines)}) the LightningModule runs "
                "manual optimization: in `training_step`, call `self.manual_backward(loss)` and then `opt.step()` "
                "and `opt.zero_grad()` for each optimizer from `self.optimizers()`."
            )

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` with every ZeRO-3 partition gathered; a collective call."""
        partitioned = [
            param
            for engine in self.engines.values()
            if engine.zero_optimization_partition_weights()
            for param in engine.module.parameters()
        ]
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
) -> EngineSet:
    """Call ``configure_optimizers`` and build one engine per optimizer, in the optimizers' order."""
    optimizers, scheduler_configs = collect_optimizers(trainer, module)
    matched = match_optimizers(module, optimizers)
    _check_overrides_have_optimizers(overrides, matched)
    manual = not module.automatic_optimization
    result = EngineSet()
    for name, index in matched.items():
        optimizer = optimizers[index]
        scheduler_config = scheduler_for(scheduler_configs, optimizer)
        params = [list(group["params"]) for group in optimizer.param_groups]
        config = engine_config(
            name, stage=stage, default=default, override=overrides.get(name, {}), precision=precision
        )
        # Manual optimization: the engine steps its scheduler in step(). Automatic: Lightning steps it,
        # by its interval, as with Lightning's DeepSpeedStrategy.
        engine_scheduler = scheduler_config.scheduler if manual and scheduler_config is not None else None
        engine = build_engine(getattr(module, name), config, optimizer, engine_scheduler)
        result.engines[name] = engine
        result.optimizers.append(EngineOptimizer(name, engine, optimizer, params))
        result.owners.update({id(p): name for p in engine.module.parameters()})
        if scheduler_config is not None:
            result.scheduler_configs.append(_visible_scheduler(name, scheduler_config, manual))
    return result


def collect_optimizers(
    trainer: pl.Trainer, module: pl.LightningModule
) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """Call ``configure_optimizers``; with several optimizers, switch the module to manual optimization."""
    conf = call._call_lightning_module_hook(trainer, "configure_optimizers", pl_module=module)
    if conf is None:
        raise ValueError(
            f"`{type(module).__name__}.configure_optimizers` returned None, so no engine would train. Return one "
            "optimizer per submodule to train, e.g. `[Adam(self.generator.parameters()), "
            "Adam(self.discriminator.parameters())]`."
        )
    optimizers, schedulers, monitor = _configure_optimizers(conf)
    if len(optimizers) > 1 and module.automatic_optimization:
        module.automatic_optimization = False
        rank_zero_info(
            f"MultiDeepSpeedStrategy: {len(optimizers)} optimizers, so `{type(module).__name__}` runs manual "
            "optimization: call `self.manual_backward(loss)` and `opt.step()` in `training_step`."
        )
    if module.automatic_optimization:
        configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    else:
        configs = _configure_schedulers_manual_opt(schedulers)
    _validate_optimizers_attached(optimizers, configs)
    _validate_scheduler_api(configs, module)
    return optimizers, configs


def _check_overrides_have_optimizers(overrides: Mapping[str, Any], matched: Mapping[str, int]) -> None:
    for name in overrides:
        if name not in matched:
            raise ValueError(
                f"`engines` configures {name!r}, but no optimizer from `configure_optimizers` trains it. Return an "
                f"optimizer over `self.{name}.parameters()`, or remove the entry."
            )


def _visible_scheduler(name: str, config: LRSchedulerConfig, manual: bool) -> LRSchedulerConfig:
    if not manual:
        return config
    visible = copy.copy(config)
    visible.scheduler = EngineScheduler(name, config.scheduler)  # type: ignore[assignment]
    return visible
