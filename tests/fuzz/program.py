"""What a case does, written once for the strategy and for plain PyTorch: modules, data, losses, training_step.

:func:`training_step` runs a case's phases against a :class:`Backend`. The Lightning module's backend
(``run_case.py``) computes each loss on its rank's batch and calls ``self.manual_backward``; the reference's
(``reference.py``) computes it on every rank's shard in one process and backpropagates each divided by the
number of ranks, which is the average DDP takes, so a term that differs per rank is reproduced as it is.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Protocol, cast

import torch
from torch import nn

from tests.fuzz.grammar import FEATURES, GLOBAL_BATCH, Call, Case, Phase, Term
from tests.patterns import CheckpointedMLP

LossOf = Callable[[torch.Tensor], torch.Tensor]
"""A loss as a function of one rank's batch (it takes its own micro-batch of it)."""

LEARNING_RATES = {"sgd": 0.2, "adam": 0.02, "adamw": 0.02, "adafactor": 0.02}


class Backend(Protocol):
    """How a training step backpropagates, steps and clears: through the strategy or in plain PyTorch."""

    def backward(self, loss_of: LossOf, plain: bool) -> None:
        """Backpropagate ``loss_of`` of each rank's batch (``loss.backward()`` where ``plain``)."""

    def before_steps(self, phase: Phase) -> None:
        """Called after a phase's backwards, before its ``zero_grad="between"`` and its steps."""

    def step(self, name: str) -> None: ...

    def zero_grad(self, name: str) -> None: ...

    def toggled(self, name: str) -> contextlib.AbstractContextManager: ...

    def no_sync(self, names: list[str]) -> contextlib.AbstractContextManager: ...

    def clip(self, name: str, max_norm: float) -> None:
        """Clip ``name``'s gradients to global norm ``max_norm`` for its coming step."""

    def edit(self, name: str, how: str) -> None:
        """Multiply ``name``'s weights by ``EDIT_FACTOR``, as ``Phase.edit`` says (plain, inplace or block)."""

    def drop_gradient(self, name: str) -> None:
        """``p.grad = None`` on the first weight of ``name`` (between the backwards and the steps)."""

    def reset_state(self, name: str) -> None:
        """Zero Adam's ``exp_avg`` of the first weight of ``name`` through ``opt.state[p]``, where it has one."""


# ---- modules and data ------------------------------------------------------------------------------------


def make_module(case: Case, name: str) -> nn.Module:
    """The submodule ``name`` of ``case``, with weights from the case's seed (an average copies its source)."""
    if case.ema is not None and name == case.ema.average:
        return copy.deepcopy(make_module(case, case.ema.source))
    index = [engine.name for engine in case.engines].index(name)
    engine = case.engines[index]
    torch.manual_seed(case.seed * 16 + index)
    hidden = case.engine(engine.shares).hidden if engine.shares else engine.hidden  # its first layer is replaced
    layers = (nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, FEATURES))
    layers[0].requires_grad_(not engine.built_frozen)
    if engine.inner_checkpoint is None:
        return nn.Sequential(*layers, *([Scale()] if engine.scalar else []))
    return CheckpointedMLP(*layers, use_reentrant=engine.inner_checkpoint == "reentrant")


class Scale(nn.Module):
    """``x * exp(log_scale)``, a learned 0-dim parameter (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros([]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.log_scale.exp()


def make_modules(case: Case) -> dict[str, nn.Module]:
    """Every submodule; one that ``shares`` gets the other's first layer, the same ``nn.Linear`` object."""
    modules = {name: make_module(case, name) for name in case.module_names}
    for engine in case.engines:
        if engine.shares:
            modules[engine.name][0] = modules[engine.shares][0]
    return modules


def make_data(case: Case) -> torch.Tensor:
    """``steps * GLOBAL_BATCH`` rows of ``x`` then ``y`` (``FEATURES`` columns each)."""
    generator = torch.Generator().manual_seed(case.seed)
    return torch.randn(case.steps * GLOBAL_BATCH, 2 * FEATURES, generator=generator)


def optimizer_params(case: Case, modules: dict[str, nn.Module], name: str) -> list[nn.Parameter]:
    """What the optimizer ``name`` holds: ``[*self.e0.parameters(), *self.e2.parameters()]`` over its parts."""
    return [param for part in case.parts(name) for param in modules[part].parameters()]


def make_optimizer(kind: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATES["sgd"])
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATES["adamw"], weight_decay=0.5)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=LEARNING_RATES["adafactor"])
    return torch.optim.Adam(params, lr=LEARNING_RATES["adam"])


def global_batch(data: torch.Tensor, step: int) -> torch.Tensor:
    return data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a global batch, as ``sharded_loader``'s ``DistributedSampler`` gives them."""
    return batch[rank::world_size]


# ---- losses ----------------------------------------------------------------------------------------------


def run_call(module: nn.Module, call: Call, h: torch.Tensor) -> torch.Tensor:
    if call.detach:
        h = h.detach()
    with torch.no_grad() if call.no_grad else contextlib.nullcontext():
        if call.checkpoint is None:
            return module(h)
        reentrant = call.checkpoint == "reentrant"
        if reentrant and not h.requires_grad:  # as Hugging Face's enable_input_require_grads: else no gradients
            h = h.detach().requires_grad_(True)
        return torch.utils.checkpoint.checkpoint(module, h, use_reentrant=reentrant)


class Chains:
    """Runs the call chains of one loss; with ``shared``, each distinct prefix once (its output reused)."""

    def __init__(self, modules: dict[str, nn.Module], shared: bool) -> None:
        self.modules = modules
        self.shared = shared
        self.outputs: dict[tuple, torch.Tensor] = {}

    def run(self, term: Term, source: torch.Tensor) -> torch.Tensor:
        h = source
        key: tuple[object, ...] = (term.source,)
        for call in term.calls:
            key = (*key, call.engine, call.detach, call.no_grad, call.checkpoint)
            if self.shared and key in self.outputs:
                h = self.outputs[key]
                continue
            h = run_call(self.modules[call.engine], call, h)
            self.outputs[key] = h
        return h


def split(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[:, :FEATURES], batch[:, FEATURES:]


def reduce(term: Term, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if term.target == "y":
        return (out - y).pow(2).mean()
    if term.target == "half":
        return (out - 0.5).pow(2).mean()
    return out.pow(2).mean()


def penalty(term: Term, chains: Chains, source: torch.Tensor) -> torch.Tensor:
    """``(|d out.sum() / d source|^2 - 1)^2`` averaged over the rows: the gradient penalty of WGAN-GP."""
    source = source.detach().requires_grad_(True)
    out = Chains(chains.modules, shared=False).run(term, source)
    (grad,) = torch.autograd.grad(out.float().sum(), source, create_graph=True)
    return (grad.pow(2).sum(1) - 1).pow(2).mean()


def term_value(term: Term, chains: Chains, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
    """The term on one rank's batch, or None where its gate is closed."""
    x, y = split(batch)
    if term.gate == "first_step" and batch_idx != 0:
        return None
    if term.gate == "data" and not x[:, 0].sum() > 0:
        return None
    source = x if term.source == "x" else y
    value = penalty(term, chains, source) if term.penalty else reduce(term, chains.run(term, source), y)
    if term.scale == "data":
        value = value * batch.abs().mean()
    return term.weight * value.float()


def phase_loss(
    phase: Phase, modules: dict[str, nn.Module], batch: torch.Tensor, batch_idx: int, micro: int, index: int
) -> torch.Tensor:
    """The phase's loss on micro-batch ``index`` of ``micro`` of one rank's batch, divided by ``micro``."""
    chunk = batch[index::micro]
    chains = Chains(modules, phase.shared)
    values = [term_value(term, chains, chunk, batch_idx) for term in phase.terms]
    present = [value for value in values if value is not None]
    return torch.stack(present).sum() / micro


# ---- training_step ---------------------------------------------------------------------------------------


def no_sync_names(case: Case, phase: Phase) -> list[str] | None:
    if phase.no_sync == "off":
        return None
    return [phase.owner] if phase.no_sync == "owner" else []


def run_backwards(backend: Backend, case: Case, phase: Phase, modules: dict[str, nn.Module], batch_idx: int) -> None:
    names = no_sync_names(case, phase)
    with backend.no_sync(names) if names is not None else contextlib.nullcontext():
        for index in range(phase.micro):

            def loss_of(batch: torch.Tensor, index: int = index) -> torch.Tensor:
                return phase_loss(phase, modules, batch, batch_idx, phase.micro, index)

            backend.backward(loss_of, phase.plain_backward)


def run_phase(backend: Backend, case: Case, phase: Phase, modules: dict[str, nn.Module], batch_idx: int) -> None:
    if phase.zero_grad == "before":
        for name in phase.steps:
            backend.zero_grad(name)
    with backend.toggled(phase.owner) if phase.toggle else contextlib.nullcontext():
        run_backwards(backend, case, phase, modules, batch_idx)
        backend.before_steps(phase)
        if phase.drop_grad:
            backend.drop_gradient(phase.owner)
        if phase.zero_grad == "between":
            for name in case.trained:
                if name not in phase.steps:
                    backend.zero_grad(name)
        for name in phase.steps:
            if phase.clip and name == phase.owner:
                backend.clip(name, phase.clip)
            backend.step(name)
    if phase.reset_state:
        backend.reset_state(phase.owner)
    if phase.zero_grad == "after":
        for name in phase.steps:
            backend.zero_grad(name)
    if phase.edit != "none":
        backend.edit(phase.owner, phase.edit)


def training_step(backend: Backend, case: Case, modules: dict[str, nn.Module], batch_idx: int) -> None:
    for engine in case.engines:
        first = cast(nn.Sequential, modules[engine.name])[0]
        if engine.unfreeze_at is not None and batch_idx >= engine.unfreeze_at:
            first.requires_grad_(True)
        elif engine.freeze_at is not None and batch_idx >= engine.freeze_at:
            first.requires_grad_(False)
    for phase in case.phases:
        run_phase(backend, case, phase, modules, batch_idx)
