"""The engines of one fit, one record each, and what the strategy asks of them between setup and teardown.

:mod:`lightning_multids._lifecycle` builds an :class:`EngineSet` at setup and releases it at teardown; in
between, the strategy's hooks call it: a backward (:meth:`EngineSet.backward`), the records a block needs
(:mod:`lightning_multids._blocks`), clearing, ``full_gradients``, and the checks Lightning's loop needs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_multids._blocks import refuse_outside_run, refuse_partitioned_weights
from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat import torch as torch_compat
from lightning_multids._config import merge
from lightning_multids._discovery import UNWALKED, Reach, reached_engines
from lightning_multids._ema import Averager
from lightning_multids._gradients import clipped, full_gradients, refuse_gradient_read
from lightning_multids._joined import part_names, split_state
from lightning_multids._optimizer import EngineOptimizer
from lightning_multids._precision import engine_dtype, loss_scaling
from lightning_multids._record import NO_SYNC, EngineRecord, Phase
from lightning_multids._routing import Router, refuse_uneven_zero3
from lightning_multids._zero_grad import route_zero_grad


@dataclass(frozen=True)
class _BackwardPlan:
    """What every backward of a fit reads that nothing changes between setup and teardown (made at the first one)."""

    trainable: list[EngineRecord]
    """The trainable engines' records, in optimizer order."""
    engines: dict[str, DeepSpeedEngine]
    """The trainable engines by name, in optimizer order."""
    fp16: bool
    """Whether a trainable engine is fp16: its loss scale then changes from step to step and is read each time."""
    zero3: list[str]
    """The trainable ZeRO-3 engines' names, sorted."""
    frozen_zero3: list[DeepSpeedEngine]
    """The frozen ZeRO-3 engines, whose leftovers a backward releases."""
    several_ranks: bool
    """Whether the fit runs on more than one rank."""


@dataclass
class EngineSet:
    """The engines of a LightningModule, one :class:`EngineRecord` each by name, and the fit's bookkeeping."""

    records: dict[str, EngineRecord] = field(default_factory=dict)
    """Every engine by name, in the order they were built (trainable ones in optimizer order)."""
    optimizer_of: dict[str, EngineOptimizer] = field(default_factory=dict)
    """Each trainable engine's optimizer for Lightning, by the engine's name."""
    scheduler_configs: list[LRSchedulerConfig] = field(default_factory=list)
    owners: dict[int, str] = field(default_factory=dict)
    """``id(parameter) -> engine name`` for the parameters of every trainable engine."""
    backward_calls: int = 0
    switched_to_manual: bool = False
    """Whether the strategy, not the user, put the module in manual optimization (several trainable engines)."""
    router: Router = field(default_factory=Router)
    """Routes each backward through the trainable engines it reaches."""
    averager: Averager | None = None
    """Updates the EMA engines after their sources' steps (``MultiDeepSpeedStrategy(ema=...)``)."""
    handles: list[RemovableHandle] = field(default_factory=list)
    """What is put on the LightningModule itself for the fit (its ``zero_grad``), removed at teardown."""
    _plan: _BackwardPlan | None = field(default=None, repr=False)
    """What every backward reads (:meth:`_backward_plan`); made again after an engine is added."""

    @property
    def engines(self) -> dict[str, DeepSpeedEngine]:
        """Every engine by name."""
        return {name: record.engine for name, record in self.records.items()}

    @property
    def optimizers(self) -> list[EngineOptimizer]:
        """The trainable engines' optimizers, in the order Lightning sees them."""
        return [self.optimizer_of[record.name] for record in self.trainable]

    @property
    def trainable(self) -> list[EngineRecord]:
        """The trainable engines' records, in optimizer order."""
        return [record for record in self.records.values() if record.trainable]

    def add(self, name: str, engine: DeepSpeedEngine, handles: list[RemovableHandle]) -> None:
        """Record an engine and the hooks registered for it; a frozen (inference) engine needs nothing more."""
        self.records[name] = EngineRecord(name, engine, handles=handles)
        self._plan = None

    def add_trainable(
        self,
        name: str,
        engine: DeepSpeedEngine,
        optimizer: Optimizer,
        params: list[list[torch.nn.Parameter]],
        handles: list[RemovableHandle],
    ) -> None:
        """Record a trainable engine, its optimizer for Lightning, and the parameters a backward can reach."""
        self.add(name, engine, handles)
        record = self.records[name]
        record.trainable = True
        self.optimizer_of[name] = EngineOptimizer(record, optimizer, params)
        record.handles.append(route_zero_grad(record, self.optimizer_of[name].zero_grad))
        record.stepped_params = [(index, p) for index, p in enumerate(engine.module.parameters()) if p.requires_grad]
        record.stepped = frozenset(index for index, _ in record.stepped_params)
        if engine.zero_optimization_stage() or engine_dtype(engine) != torch.float32:
            record.untrained = [(key, p) for key, p in engine.module.named_parameters() if not p.requires_grad]
        record.keeps_master = ds_compat.keeps_master_copy(engine)
        if record.keeps_master:
            record.params = list(engine.module.parameters())
        self.owners.update({id(p): name for p in engine.module.parameters()})

    def engine_of(self, name: str) -> tuple[str, str | None]:
        """The name of the engine holding submodule ``name``, and ``name`` again where that engine is over several.

        Code names submodules by their attributes: ``"decoder"`` is a part of the engine ``"encoder"`` where one
        optimizer trains both (:mod:`lightning_multids._joined`). Any other name is returned as it is, with None.
        """
        for engine_name, record in self.records.items():
            parts = part_names(record.engine.module)
            if parts is not None and name in parts:
                return engine_name, name
        return name, None

    def held_names(self) -> set[str]:
        """The names of the submodules the engines hold: each engine's, and each part of an engine over several."""
        return {part for name, record in self.records.items() for part in part_names(record.engine.module) or [name]}

    def engine_names(self, names: Collection[str]) -> tuple[str, ...]:
        """``names`` with each part of an engine over several submodules replaced by that engine's name, once."""
        return tuple(dict.fromkeys(self.engine_of(name)[0] for name in names))

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
                ds_compat.set_gradient_clipping(optimizer.engine, float(clip))

    @property
    def trainable_engines(self) -> dict[str, DeepSpeedEngine]:
        """The trainable engines by name, in optimizer order."""
        return {record.name: record.engine for record in self.trainable}

    def _backward_plan(self) -> _BackwardPlan:
        if self._plan is None:
            engines = self.trainable_engines
            self._plan = _BackwardPlan(
                trainable=self.trainable,
                engines=engines,
                fp16=any(engine.fp16_enabled() for engine in engines.values()),
                zero3=sorted(name for name, engine in engines.items() if engine.zero_optimization_stage() == 3),
                frozen_zero3=[
                    record.engine
                    for record in self.records.values()
                    if not record.trainable and record.engine.zero_optimization_stage() == 3
                ],
                several_ranks=_several_ranks(),
            )
        return self._plan

    def _release_frozen_leftovers(self, plan: _BackwardPlan) -> None:
        """After a backward, ended or failed: release what it gathered of frozen ZeRO-3 engines and left gathered."""
        for engine in plan.frozen_zero3:
            ds_compat.release_after_backward(engine)

    def clear_gradients(self) -> None:
        """Clear every trainable engine's gradients, as ``opt.zero_grad()`` on each would."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def full_gradients(self, name: str) -> dict[str, torch.Tensor]:
        """Engine ``name``'s whole gradients, averaged over ranks (``gradients.full_gradients``).

        For a part of an engine over several submodules, that part's, keyed within it (clipped with the engine's).
        """
        name, part = self.engine_of(name)
        grads = self._full_gradients(name)
        return grads if part is None else split_state(grads, part_names(self.records[name].engine.module) or [])[part]

    def _full_gradients(self, name: str) -> dict[str, torch.Tensor]:
        trainable = self.trainable_engines
        refuse_outside_run(f"full_gradients({name!r})", trainable)
        if name not in trainable:
            raise ValueError(
                f"`full_gradients({name!r})`: there is no trainable engine {name!r} now. Trainable engines exist "
                f"during fit: {sorted(trainable)}."
            )
        engine = trainable[name]
        if NO_SYNC in self.records[name].blocks and engine.zero_optimization_partition_gradients():
            stage = engine.zero_optimization_stage()
            raise RuntimeError(
                f"`full_gradients({name!r})` inside `strategy.no_sync(...)`: the ZeRO-{stage} "
                f"engine {name!r} keeps the block's gradients on each rank, unreduced, until the block ends. Read "
                "them after the `with` block."
            )
        grads = full_gradients(engine, name, self.records[name].has_gradients)
        max_norm = self.optimizer_of[name].pending_clip
        return grads if max_norm is None or not grads else clipped(grads, max_norm)

    def guard_parameters(self) -> Callable[[], None]:
        """Refuse user code's accesses to state that is DeepSpeed's, not DDP's, where it is touched; the undo.

        ``param.grad`` of a trainable engine between a backward and its step (``_gradients.refuse_gradient_read``),
        and ``param.data`` of a ZeRO-3 engine where no submodule holding it runs, outside ``gathered`` blocks
        (``_blocks.refuse_partitioned_weights``). Each engine's
        :class:`~lightning_multids._compat.torch.ParameterGuard` is suspended while the strategy runs the backward
        and the engine's step, so most of DeepSpeed's own accesses cost nothing extra.
        """

        def undo() -> None:
            for record in self.records.values():
                if record.guard is not None:
                    record.guard.close()
                record.guard = None

        try:
            for record in self.records.values():
                self._guard(record)
        except BaseException:
            undo()
            raise
        return undo

    @staticmethod
    def _guard(record: EngineRecord) -> None:
        checks: dict[str, torch_compat.Check] = {}
        stage = record.engine.zero_optimization_stage()
        if record.trainable:
            checks["grad"] = refuse_gradient_read(record.name, stage)
        if stage == 3:
            checks["data"] = refuse_partitioned_weights(record.name)
        elif record.keeps_master:  # an access may edit the weights: the next step carries them to the master copy
            checks["data"] = record.note_edit
        if not checks:
            return
        record.guard = torch_compat.ParameterGuard(list(record.engine.module.parameters()), checks)
        if record.has_gradients:
            record.guard.enable("grad")
        if "data" in checks:
            record.guard.enable("data")

    def note_collective_write(self, tensor: torch.Tensor) -> None:
        """A collective of user code wrote into ``tensor``: an edit, where it is a trained engine's weight."""
        for record in self.trainable:
            record.note_write(tensor)

    def take_weight_edits(self) -> None:
        """Carry edits of the trainable engines' weights since their last step into their fp32 master copies."""
        for record in self.trainable:
            record.take_edits()

    def saved_names(self, save_frozen: bool) -> list[str]:
        """The engines a checkpoint holds: the trainable ones, the EMA engines, and the frozen ones if asked."""
        averages = set(self.averager.averages) if self.averager is not None else set()
        frozen = self.frozen_names() - averages
        return [name for name in self.engines if save_frozen or name not in frozen]

    def frozen_names(self) -> set[str]:
        """The names of the frozen (optimizer-less) engines."""
        return {name for name, record in self.records.items() if not record.trainable}

    @contextmanager
    def backward(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Route the body's backward of the yielded (loss-scaled) tensor through every engine ``loss`` reaches.

        Raises if ``loss`` reaches no trainable engine (it would train nothing); with several ranks and
        ``find_unused_parameters=True``, only if it reaches none on any rank (the ranks agree after each backward,
        see :func:`~lightning_multids._routing.agree`). An exception in the backward leaves the engines it reached
        clean, without their gradients of this step. A body that runs no backward (a ``LightningModule.backward``
        override that skips a batch) leaves the engines without gradients, so the next step changes nothing, as
        under DDP.
        """
        plan = self._backward_plan()
        for record in plan.trainable:
            record.refuse_backward()
        guards = [record.guard for record in self.records.values() if record.guard is not None]
        before = [record.phase for record in plan.trainable]
        for record in plan.trainable:
            record.phase = Phase.BACKWARD
        for guard in guards:  # DeepSpeed's accesses to the parameters in the backward: at no cost
            guard.suspend()
        try:
            with self._routed(loss, plan) as scaled:
                yield scaled
        finally:
            for guard in guards:
                guard.resume()
            for record, phase in zip(plan.trainable, before, strict=True):
                record.phase = phase

    @contextmanager
    def _routed(self, loss: torch.Tensor, plan: _BackwardPlan) -> Iterator[torch.Tensor]:
        self._refuse_unfrozen()
        agreeing = self.router.find_unused and plan.several_ranks
        if loss.grad_fn is None:
            if not agreeing:
                self._refuse_untrained()
            loss = loss.detach() + torch.zeros((), device=loss.device, requires_grad=True)  # agree with the others
        reach, scale, factors = self._fp16_scaling(loss, plan) if plan.fp16 else (UNWALKED, 1.0, {})
        if plan.zero3 and agreeing:
            walked = reach if reach is not UNWALKED else reached_engines(loss, self.owners)
            refuse_uneven_zero3(walked, plan.zero3, plan.engines[plan.zero3[0]].device)
        with self.router.routed(loss, plan.engines, reach, factors) as route:
            try:
                yield loss * scale if scale != 1.0 else loss
            except BaseException:
                self._mark_gradients(route.entered, False)  # routed() drops them
                self._release_frozen_leftovers(plan)
                raise
        self._release_frozen_leftovers(plan)
        if not route.entered and route.ran:  # no backward ran (a skipping `backward` override): no gradients, as DDP
            self._refuse_untrained()
        self.backward_calls += 1
        self._mark_gradients(route.entered, True)
        for name in route.entered:
            self.records[name].note_reach(route.missing.get(name, []))

    def _fp16_scaling(self, loss: torch.Tensor, plan: _BackwardPlan) -> tuple[Reach, float, dict[str, float]]:
        """The walk, loss scale and gradient factors of a backward where some trainable engine is fp16.

        At one scale for every engine the loss's reach does not matter: no walk, no factors. At different scales
        the loss is scaled for the engines it reaches, found by a walk (:func:`precision.loss_scaling`).
        """
        scales = {name: ds_compat.loss_scale(engine) for name, engine in plan.engines.items()}
        if len(set(scales.values())) == 1:
            return UNWALKED, next(iter(scales.values())), {}
        reach = reached_engines(loss, self.owners)
        scale, factors = loss_scaling(scales if reach.hidden else {n: scales[n] for n in reach.names})
        return reach, scale, factors

    def _mark_gradients(self, names: Collection[str], present: bool) -> None:
        for name in names:
            self.records[name].has_gradients = present

    def _refuse_unfrozen(self) -> None:
        """Refuse a backward once a parameter frozen when its ZeRO-1/2/3 engine was built requires a gradient."""
        for record in self.records.values():
            for key, param in record.untrained:
                if param.requires_grad:
                    engine = record.engine
                    kept = f"ZeRO-{engine.zero_optimization_stage()} in {str(engine_dtype(engine)).split('.')[-1]}"
                    raise ValueError(
                        f"The parameter {key!r} of engine {record.name!r} had `requires_grad=False` when the engine "
                        f"was built and requires a gradient now: its optimizer ({kept}) made its partitions and "
                        "fp32 copies of the parameters that trained then, so this one would never train. Keep it "
                        "`requires_grad=True` from the start, in a parameter group with `lr` 0 until it is to "
                        f"train (then set the group's `lr`), or give {record.name!r} ZeRO-0 in fp32."
                    )

    def _refuse_untrained(self) -> None:
        trainable = ", ".join(repr(record.name) for record in self.trainable)
        raise ValueError(
            f"`manual_backward` got a loss that reaches no trainable engine ({trainable}): it would train "
            "nothing. Compute the loss from the outputs of those submodules without `.detach()` or "
            "`torch.no_grad()`, and check that `toggle_optimizer` has not turned off the gradients of the engine "
            "you mean to train. Where the loss reaches an engine on some ranks only, each rank's backward must "
            "still run through it: `MultiDeepSpeedStrategy(find_unused_parameters=True)` makes the ranks agree "
            "after each backward."
        )

    def for_no_sync(self, names: tuple[str, ...]) -> list[EngineRecord]:
        """The records of the trainable engines called ``names`` (all of them when empty) for a ``no_sync`` block.

        Refuses names that are not trainable engines, and a call outside fit.
        """
        what = "no_sync"
        trainable = [record.name for record in self.trainable]
        refuse_outside_run(what, trainable)
        unknown = [name for name in names if name not in trainable]
        if unknown:
            frozen = sorted(set(unknown) & self.frozen_names())
            reason = f" ({frozen} are frozen: they have no gradients to reduce)" if frozen else ""
            raise ValueError(
                f"`{what}` got {unknown}, which are not trainable engines{reason}. Choose from {trainable}."
            )
        return [self.records[name] for name in names or trainable]

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
                f"{len(self.trainable)} trainable engines ({', '.join(repr(r.name) for r in self.trainable)}) the "
                "LightningModule runs "
                "manual optimization: in `training_step`, call `self.manual_backward(loss)` and then `opt.step()` "
                "and `opt.zero_grad()` for each optimizer from `self.optimizers()`."
            )


def _several_ranks() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
