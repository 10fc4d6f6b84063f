"""One engine's state during a fit, in one record: the one place routing, the blocks and the optimizer read and write.

Each engine of a fit has one :class:`EngineRecord` (built at setup by :mod:`lightning_multids._lifecycle`, kept in
:class:`~lightning_multids._engines.EngineSet`). It says whether the engine trains, what it is doing now
(:class:`Phase`), whether it holds gradients, and which blocks it is inside. The modules that change that state
write it here and read it here; none of them asks another:

* a routed backward (:meth:`EngineSet.backward <lightning_multids._engines.EngineSet.backward>`) puts the trainable
  engines in :attr:`Phase.BACKWARD` while it runs, and marks the engines it reached as holding gradients;
* the optimizer (:class:`~lightning_multids._optimizer.EngineOptimizer`) puts its engine in :attr:`Phase.STEP` while
  it steps, and clears the mark; it calls :meth:`EngineRecord.refuse_step` first;
* the blocks (:mod:`lightning_multids._blocks`) add themselves to and remove themselves from ``blocks``.

This module imports nothing of the package but ``_compat``, so each of those can import it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from deepspeed import DeepSpeedEngine
from torch.utils.hooks import RemovableHandle

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat import torch as torch_compat
from lightning_multids._compat.torch import ParameterGuard

NO_SYNC = "strategy.no_sync(...)"
"""The block in which a trainable engine keeps its gradients local (:func:`lightning_multids._blocks.no_sync`)."""


class BlockError(RuntimeError):
    """A block used where it cannot work: nested in a block of its kind, or an engine stepped inside one."""


class PhaseError(RuntimeError):
    """An engine asked to step during a backward that runs through it, or to run a backward during its step."""


class Phase(enum.Enum):
    """What an engine is doing now (as FSDP2's ``TrainingState``)."""

    IDLE = "idle"
    """Between steps: no backward through it and no step of it runs (it may hold gradients)."""
    BACKWARD = "backward"
    """A routed backward (``self.manual_backward``) is running; it may reach the engine."""
    STEP = "step"
    """Its optimizer is stepping it: ``engine.step()``, then the EMA engines that follow it (not the step hooks of
    ``self.optimizers()``, which run around that, nor the closure of ``opt.step(closure)``, which runs before it)."""


@dataclass(eq=False)
class EngineRecord:
    """One engine of a fit: everything the strategy keeps about it, in one place."""

    name: str
    """The submodule's attribute name."""
    engine: DeepSpeedEngine
    trainable: bool = False
    """Whether it has an optimizer (it was built from ``configure_optimizers``); frozen and EMA engines have none."""
    phase: Phase = Phase.IDLE
    blocks: list[str] = field(default_factory=list)
    """The blocks it is inside now, outermost first (:mod:`lightning_multids._blocks`)."""
    handles: list[RemovableHandle] = field(default_factory=list)
    """The hooks registered for it at setup, removed at teardown."""
    guard: ParameterGuard | None = None
    """Refuses user code's accesses to its parameters' ``grad`` and ``data`` where they are not DDP's (during fit)."""
    untrained: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    """A trainable engine's parameters that had ``requires_grad=False`` when it was built (by name), where its
    optimizer holds no partition or fp32 copy of them, so they can never train: at ZeRO-1/2/3, and at ZeRO-0 in
    bf16 or fp16 (DeepSpeed's 16-bit optimizers keep fp32 copies of the trained parameters only)."""
    configured_clipping: float | None = None
    """The engine's own clipping, while a ``clip_gradients`` call overrides it for its next step."""
    keeps_master: bool = False
    """Whether its optimizer steps a master copy of the weights, which edits must reach (``ds_compat``)."""
    params: list[torch.nn.Parameter] = field(default_factory=list)
    """A trainable engine's parameters, in the module's order, where it keeps a master copy."""
    edited: bool = True
    """Whether a path that can edit the weights ran since the master copy last took them: a ``param.data`` access
    (the guard), a ``gathered`` or ``offloaded`` block, a collective of user code writing into a weight. (True at
    the start: the first step takes whatever happened before it.)"""
    storages: set[int] = field(default_factory=set)
    """Where its parameters' storages start, for :meth:`note_write` (made again at each take of edits)."""
    without_gradient: set[int] | None = None
    """Since its last step or ``zero_grad``: its parameters (indices in the module's order) that no backward gave a
    gradient on any rank; None before the first backward (:meth:`note_reach`)."""
    stepped: frozenset[int] = frozenset()
    """The parameters (indices in the module's order) its optimizer steps: those that required a gradient when the
    engine was built (the others have no partition, master copy or state to keep)."""
    stepped_params: list[tuple[int, torch.nn.Parameter]] = field(default_factory=list)
    """Those parameters with their indices (:meth:`thaw_held_gradients` reads their ``requires_grad`` each step)."""
    unreached: set[int] | None = None
    """Since its last step or ``zero_grad``: the stepped parameters that no backward gave a gradient (None before the
    first backward); zeros left by ``zero_grad(set_to_none=False)`` are no gradient here, unlike
    :attr:`without_gradient`."""
    _versions: list[int] = field(default_factory=list)
    _has_gradients: bool = False

    @property
    def has_gradients(self) -> bool:
        """Whether a backward reached the engine since its last step or ``zero_grad``."""
        return self._has_gradients

    @has_gradients.setter
    def has_gradients(self, value: bool) -> None:
        self._has_gradients = value
        if not value:
            self.without_gradient = self.unreached = None
        if self.guard is not None:  # reads of `param.grad` are refused from user code while it holds gradients
            (self.guard.enable if value else self.guard.disable)("grad")

    def note_reach(self, missing: list[int]) -> None:
        """A backward reached the engine and gave no gradient to its parameters ``missing`` (by index).

        At ZeRO-3 it refuses one of them that is frozen now and holds an earlier backward's gradient: the end of
        this backward dropped that gradient (ZeRO-3 keeps the reduced gradients of the parameters that require one),
        where ``torch.optim`` would apply it.
        """
        stepped = set(self.stepped.intersection(missing))
        if self.unreached is not None and stepped - self.unreached and self.engine.zero_optimization_stage() == 3:
            self._refuse_dropped_gradients(stepped - self.unreached)
        self.unreached = stepped if self.unreached is None else self.unreached & stepped
        self.without_gradient = stepped if self.without_gradient is None else self.without_gradient & stepped

    def _refuse_dropped_gradients(self, held: set[int]) -> None:
        frozen = [index for index, param in self.stepped_params if index in held and not param.requires_grad]
        if frozen:
            name = [name for name, _ in self.engine.module.named_parameters()][frozen[0]]
            raise RuntimeError(
                f"A backward reached engine {self.name!r} (ZeRO-3) while its parameter {name!r} is frozen "
                "(`requires_grad=False`) and holds a gradient of an earlier backward since the last `opt.step()` or "
                "`zero_grad()`: ZeRO-3 keeps the reduced gradients of the parameters that require one at the end of "
                "each backward, so that gradient was dropped, where `torch.optim` would apply it. Freeze the "
                "parameter after `opt.step()` or `opt.zero_grad()`, or before the backward that gives it a gradient."
            )

    def thaw_held_gradients(self) -> Callable[[], None] | None:
        """Before a step: what freezes again the stepped parameters that are frozen now and hold a gradient.

        ``torch.optim`` steps a parameter whose ``grad`` is set, whatever its ``requires_grad`` (a layer frozen
        after its backward; Lightning's ``toggle_optimizer`` freezing the other optimizers' parameters, where one of
        those is stepped inside it). DeepSpeed's ``step()`` reduces (ZeRO-0) or takes out of its buffers (ZeRO-2
        with an offloaded optimizer) only the gradients of parameters that require one: such a parameter would be
        stepped with this rank's own gradient, or with none. They require one while the engine steps. None where
        there is none, which costs a read of ``requires_grad`` per parameter.
        """
        held = self.without_gradient or set()
        frozen = [param for index, param in self.stepped_params if not param.requires_grad and index not in held]
        if not frozen:
            return None
        for param in frozen:
            param.requires_grad_(True)

        def freeze() -> None:
            for param in frozen:
                param.requires_grad_(False)

        return freeze

    def hold_untouched(self) -> Callable[[], None] | None:
        """Before a step, where some parameter got no gradient since the last clear: what puts it back after the step.

        Its weights and optimizer state stay as they are, as ``torch.optim`` skips a parameter whose gradient is
        None. None, at no cost, where every parameter got one.
        """
        if not self.without_gradient:
            return None
        params = list(self.engine.module.parameters())
        return ds_compat.hold_still(self.engine, [params[index] for index in sorted(self.without_gradient)])

    def take_edits(self) -> None:
        """Carry edits of the weights since the last take into the master copy, where an edit may have happened.

        An edit is seen as :attr:`edited`, or as a new version of a parameter (an in-place op on it: ``p.clamp_()``,
        ``nn.init``, ``load_state_dict``'s copies). DeepSpeed's own writes of the weights after a step go through
        their storage and raise no version. Otherwise nothing is copied: no per-step copy of the weights into the
        master copy (over PCIe where it is offloaded), only a read of each parameter's version.
        """
        if not self.keeps_master:
            return
        versions = torch_compat.versions(self.params)
        if self.edited or versions != self._versions:
            ds_compat.take_weight_edits(self.engine)
            self.edited = False
            self.storages = {torch_compat.storage_of(param) for param in self.params} - {0}
        self._versions = versions

    def note_write(self, tensor: torch.Tensor) -> None:
        """A collective wrote into ``tensor`` (``dist.broadcast(p, 0)``): where it is one of the weights, an edit."""
        if self.keeps_master and torch_compat.storage_of(tensor) in self.storages:
            self.edited = True

    def note_edit(self, param: torch.Tensor, reader: str, verb: str) -> None:
        """A :class:`ParameterGuard` check: a ``param.data`` access may edit the weights; the next step takes them."""
        self.edited = True

    @contextmanager
    def in_phase(self, phase: Phase) -> Iterator[None]:
        """The engine in ``phase`` for the body, and in the phase it was in before after it, whatever happens."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def refuse_step(self) -> None:
        """Raise if the engine cannot step now: inside a block (:class:`BlockError`), or in a backward."""
        if self.phase is Phase.BACKWARD:
            raise PhaseError(
                f"`opt.step()` of engine {self.name!r} during a `self.manual_backward(...)` (from a hook that runs in "
                "the backward, as an optimizer stepped in backward is): the strategy steps an engine only between "
                "backwards, once DeepSpeed has reduced the gradients of the engines the backward reaches, which it "
                "does when the backward ends. Call `opt.step()` after `self.manual_backward(loss)` returns."
            )
        if not self.blocks:
            return
        if NO_SYNC in self.blocks:
            raise BlockError(
                f"`opt.step()` of engine {self.name!r} inside `{NO_SYNC}`: its gradients are not reduced until the "
                "block ends. Call `opt.step()` after the `with` block."
            )
        raise BlockError(
            f"`opt.step()` of engine {self.name!r} inside `{self.blocks[-1]}`, where the engine cannot step (its "
            "states are off the device, or its weights whole outside ZeRO-3). Call `opt.step()` after the block."
        )

    def refuse_backward(self) -> None:
        """Raise :class:`PhaseError` if the engine is stepping (a backward from code its step runs)."""
        if self.phase is Phase.STEP:
            raise PhaseError(
                f"`self.manual_backward(...)` during `opt.step()` of engine {self.name!r} (from code its step runs: a "
                "step hook of the torch optimizer DeepSpeed steps, or a callback after the step): the engine is "
                "applying its gradients and clearing them. Run the backward before `opt.step()`, or inside the "
                "closure passed to it."
            )
