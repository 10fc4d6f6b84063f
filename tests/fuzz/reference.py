"""The reference: a case trained in one process of plain PyTorch, and the steps a draft case may take.

Each backward runs once per rank's shard of the global batch, on ``loss / world_size``: the average of the
ranks' gradients that DDP (and the strategy) take, also where a term depends on the rank's own data. The
conventions the strategy documents are followed: ``opt.step()`` leaves a parameter that no rank's backward gave a
gradient as ``torch.optim`` does, except one that requires a gradient in a fit without ``find_unused_parameters``,
which it steps with a zero gradient (docs/limitations.md: momentum moves it), and clears the gradients it applied
(as DeepSpeed does); an EMA average follows ``AveragedModel`` with
``get_ema_multi_avg_fn`` after each step of its source; ``full_gradients`` of an engine holds its trainable
parameters' averaged gradients (zeros where none arrived). A resume (``Case.resume``) starts with no gradients
(a checkpoint holds none, as under DDP); resumed without ``ema=``, the average stops following its source.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.fuzz import program
from tests.fuzz.grammar import EDIT_FACTOR, WORLD_SIZE, Case, Phase

Grads = dict[str, torch.Tensor]


@dataclass
class Read:
    """What a hook read: ``full_gradients(engine)`` in ``on_after_backward`` or ``on_before_optimizer_step``."""

    hook: str
    engine: str
    grads: Grads

    def to_dict(self) -> dict[str, Any]:
        return {"hook": self.hook, "engine": self.engine, "grads": self.grads}


@dataclass
class Result:
    weights: dict[str, torch.Tensor]
    reads: list[Read] = field(default_factory=list)


def weights(modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.detach().float().clone() for name, m in modules.items() for k, v in m.state_dict().items()}


def gradients(module: nn.Module) -> Grads:
    """What ``full_gradients`` returns for ``module`` where its gradients are whole: zeros for a missing one."""
    return {
        key: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
        for key, p in module.named_parameters()
        if p.requires_grad
    }


class InvalidCase(Exception):
    """The draft does something plain PyTorch refuses, or that the strategy refuses by design."""


class ReferenceBackend:
    """Plain PyTorch for :func:`program.training_step`; records what the hooks read, and which engines a
    backward reaches on which rank (for :func:`resolve`)."""

    def __init__(self, case: Case, modules: dict[str, nn.Module]) -> None:
        self.case, self.modules = case, modules
        for name in case.module_names:
            if name not in case.trained:
                modules[name].requires_grad_(False)
        self.optimizers = {
            name: program.make_optimizer(str(case.engine(name).optimizer), modules[name].parameters())
            for name in case.trained
        }
        self.engine_steps: dict[str, int] = {}
        """Each trained engine's steps so far (Adam's step count over ZeRO-1/2/3's partitions)."""
        self.averaged = 0
        self.following = True
        """Whether the EMA average follows its source (not after a resume without ``ema=``)."""
        self.shards: list[torch.Tensor] = []
        self.reads: list[Read] = []
        self.rank = 0
        self.entered: set[int] = set()
        self.reached: dict[str, set[int]] = {name: set() for name in case.trained}
        """The ranks on which each trained engine holds gradients (since its last step or zero_grad)."""
        self.wanted: list[tuple[Phase, list[str]]] = []
        """Per phase run, the optimizers its ``step`` policy asks for (see :func:`resolve`)."""
        self.needs_find_unused = False
        """Whether a backward reaches an engine on some ranks only, or a ZeRO-2/3 engine in part."""
        self._now: dict[str, set[int]] = {}
        self._hooks = [
            p.register_hook(lambda grad, name=name, index=index: self._arrived(name, index))
            for name in case.trained
            for index, p in enumerate(modules[name].parameters())
            if p.requires_grad  # a layer shared with a frozen engine is frozen (the strategy refuses the case)
        ]

    def _arrived(self, name: str, index: int) -> None:
        self.reached[name].add(self.rank)
        self.entered.add(self.rank)
        self._now.setdefault(name, set()).add(index)

    def _note_reach(self, per_rank: list[dict[str, set[int]]]) -> None:
        """What one backward reached on each rank: does the strategy need ``find_unused_parameters=True``?"""
        for name in self.case.trained:
            reaching = [now[name] for now in per_rank if now.get(name)]
            trained = {i for i, p in enumerate(self.modules[name].parameters()) if p.requires_grad}
            partial = self.case.engine(name).stage >= 2 and any(trained - now for now in reaching)
            self.needs_find_unused |= partial or 0 < len(reaching) < len(per_rank)

    def backward(self, loss_of: program.LossOf, plain: bool) -> None:
        self.entered = set()
        per_rank = []
        for rank, batch in enumerate(self.shards):
            self.rank, self._now = rank, {}
            loss = loss_of(batch)
            if loss.grad_fn is None:
                raise InvalidCase(f"a loss needs no gradient on rank {rank}")
            (loss / len(self.shards)).backward()
            if rank not in self.entered:
                raise InvalidCase(f"a backward reaches no trained engine on rank {rank}")
            per_rank.append(self._now)
        self._note_reach(per_rank)
        if not plain:
            self.reads += [Read("after_backward", n, gradients(self.modules[n])) for n in self.case.read_after_backward]

    def before_steps(self, phase: Phase) -> None:
        everywhere = [name for name in self.case.trained if len(self.reached[name]) == len(self.shards)]
        if phase.step == "owner":
            everywhere = [name for name in everywhere if name == phase.owner]
        self.wanted.append((phase, everywhere))

    def step(self, name: str) -> None:
        if len(self.reached[name]) != len(self.shards):
            raise InvalidCase(f"{name} steps without gradients on every rank")
        if self.case.read_before_step:
            self.reads.append(Read("before_step", name, gradients(self.modules[name])))
        for p in self.modules[name].parameters():  # docs/limitations.md: without find_unused_parameters a ZeRO-0/1
            if p.grad is None and p.requires_grad and not self.case.find_unused:  # engine steps what no rank's
                p.grad = torch.zeros_like(p)  # backward reached with a zero gradient; torch.optim skips it otherwise
        engine = self.case.engine(name)
        if engine.stage > 0 and engine.optimizer in ("adam", "adamw"):
            share_step_count(self.optimizers[name], self.engine_steps.get(name, 0))
        self.engine_steps[name] = self.engine_steps.get(name, 0) + 1
        self.optimizers[name].step()
        self.zero_grad(name)  # the strategy's opt.step() clears the gradients it applied, as DeepSpeed's step does
        ema = self.case.ema
        if ema is not None and ema.source == name and self.following:
            move_towards(self.modules[ema.average], self.modules[name], 1.0 if not self.averaged else 1 - ema.decay)
            self.averaged += 1

    def zero_grad(self, name: str) -> None:
        self.optimizers[name].zero_grad()
        self.reached[name].clear()

    @contextlib.contextmanager
    def toggled(self, name: str) -> Iterator[None]:
        """Lightning's ``toggle_optimizer``: only ``name``'s optimizer's parameters require gradients."""
        saved = {p: p.requires_grad for n in self.case.trained for p in self.modules[n].parameters()}
        for p in saved:
            p.requires_grad_(False)
        for p in self.modules[name].parameters():
            p.requires_grad_(saved[p])
        try:
            yield
        finally:
            for p, flag in saved.items():
                p.requires_grad_(flag)

    def no_sync(self, names: list[str]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the same mathematics with or without it

    def clip(self, name: str, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.modules[name].parameters(), max_norm)  # the averaged gradients, as DDP's

    def edit(self, name: str, how: str) -> None:
        with torch.no_grad():
            for p in self.modules[name].parameters():
                p.mul_(EDIT_FACTOR)


def share_step_count(optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Give every parameter of an Adam the engine's step count ``steps``, as ZeRO-1/2/3's flat partitions have one
    (docs/limitations.md): a parameter that skipped steps is bias-corrected with it; torch counts each one's own."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:  # what Adam makes at a parameter's first step
                state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] = torch.tensor(float(steps))


def move_towards(average: nn.Module, source: nn.Module, weight: float) -> None:
    """``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))``: copy first, then ``lerp_(source, 1 - decay)``."""
    with torch.no_grad():
        for a, s in zip(average.parameters(), source.parameters(), strict=True):
            a.lerp_(s, weight)
        for mine, theirs in zip(average.buffers(), source.buffers(), strict=True):
            mine.copy_(theirs)


def train(case: Case, dtype: torch.dtype = torch.float32, nudged: bool = False) -> tuple[Result, ReferenceBackend]:
    """Train ``case`` in plain PyTorch, each module's weights in ``dtype`` and its inputs cast to it (as the
    strategy casts an engine's), each initial weight moved by one ulp up or down if ``nudged``; the data, and so
    every data-dependent term, stay fp32. Raise :class:`InvalidCase` where it cannot be a fuzz case."""
    modules = {name: module.to(dtype) for name, module in program.make_modules(case).items()}
    if dtype != torch.float32:
        for module in modules.values():
            module.register_forward_pre_hook(lambda _, args: tuple(a.to(dtype) for a in args))
    if nudged:
        nudge(modules, case.seed)
    backend = ReferenceBackend(case, modules)
    data = program.make_data(case)
    for step in range(case.steps):
        if case.resume is not None and step == case.resume.at:
            for name in case.trained:
                backend.zero_grad(name)
            backend.following = not case.resume.drop_ema
        batch = program.global_batch(data, step)
        backend.shards = [program.shard(batch, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
        try:
            program.training_step(backend, case, modules, step)
        except (RuntimeError, ValueError) as error:  # e.g. a tensor changed in place that a backward needs
            raise InvalidCase(f"plain PyTorch raised {type(error).__name__}: {error}") from error
    return Result(weights(modules), backend.reads), backend


def reference(case: Case, dtype: torch.dtype = torch.float32) -> Result:
    return train(case, dtype)[0]


def rounding_noise(case: Case) -> tuple[Result, str]:
    """What rounding alone does to ``case`` in plain PyTorch, and how it was found: trained in bf16 for a bf16 case,
    else in fp32 from initial weights one ulp away. Its distance from :func:`reference` is the case's noise floor."""
    if case.precision == "bf16-mixed":
        return train(case, torch.bfloat16)[0], "plain PyTorch with bf16 weights"
    return train(case, nudged=True)[0], "plain PyTorch from initial weights one ulp away"


def nudge(modules: dict[str, nn.Module], seed: int) -> None:
    """Move every weight by one ulp, up or down at random (``seed``); a layer two modules share, once each."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in modules.values():
            for param in module.parameters():
                up = torch.rand(param.shape, generator=generator) < 0.5
                towards = torch.where(up, torch.inf, -torch.inf).to(param.dtype)
                param.copy_(torch.nextafter(param, towards))


def supported(case: Case) -> bool:
    """DeepSpeed's ``BF16_Optimizer`` (fp32 gradient accumulation under bf16) exists at ZeRO-1 only, without
    offloading; elsewhere DeepSpeed refuses the mix (``NotImplementedError: unsupported mix``). A resume needs a
    step on each side of the save, and names what the case has."""
    if not all(
        not e.fp32_grad_accum or (case.precision == "bf16-mixed" and e.stage == 1 and not e.offload)
        for e in case.engines
    ):
        return False
    names = [engine.name for engine in case.engines]
    if any(e.shares is not None and e.shares not in names[: names.index(e.name)] for e in case.engines):
        return False
    resume = case.resume
    if resume is None:
        return True
    frozen = {engine.name for engine in case.engines if not engine.trained}
    changed = [case.engine(name) for name in resume.stages if name in names]
    return (
        0 < resume.at < case.steps
        and set(resume.stages) <= set(names)
        and not any(engine.offload or engine.fp32_grad_accum for engine in changed)
        and (resume.inside is None or resume.inside in case.module_names)
        and set(resume.drop_frozen) <= frozen
        and (case.ema is not None or not resume.drop_ema)
    )


def refusal(case: Case) -> str | None:
    """What the strategy must refuse in ``case``, as a pattern of its message; None where it must train.

    Two engines sharing a layer, at setup; a plain edit (``p.data``) of a ZeRO-3 engine's weights, at the edit; a
    resume that changes a trained engine's ZeRO stage other than between 1 and 2 (DeepSpeed cannot load the
    optimizer state), at load.
    """
    if any(engine.shares for engine in case.engines):  # two optimizers holding it are refused first
        return "share a parameter|is in optimizer [0-9] and optimizer [0-9]"
    edited = {phase.owner for phase in case.phases if phase.edit == "plain"}
    partitioned = r"\(ZeRO-3\) was (read|set) outside"
    if any(case.engine(name).stage == 3 for name in edited):
        return partitioned
    if case.resume is not None:
        for name, stage in case.resume.stages.items():
            engine = case.engine(name)
            if engine.trained and stage != engine.stage and {stage, engine.stage} != {1, 2}:
                return "DeepSpeed cannot load its optimizer state into another stage"
        if any(case.resume.stages.get(name, case.engine(name).stage) == 3 for name in edited):
            return partitioned
    return None


def resolve(case: Case) -> Case | None:
    """``case`` with each phase's ``steps`` filled from its ``step`` policy, or None if it is not a valid case.

    A phase steps, in every training step, the engines its policy names that hold gradients on every rank
    then (owner first); since clearing and stepping change what later phases hold, this repeats to a fixed
    point. Invalid: plain PyTorch fails, a backward reaches no trained engine on some rank (the strategy
    refuses it, as documented), or nothing steps.
    """
    if not supported(case):
        return None
    case = copy.deepcopy(case)
    for _ in range(6):
        try:
            _, backend = train(case)
        except InvalidCase:
            return None
        chosen = {id(phase): list(phase.steps) for phase in case.phases}
        for phase in case.phases:
            runs = [wanted for p, wanted in backend.wanted if p is phase]
            common = [name for name in runs[0] if all(name in run for run in runs)] if runs else []
            chosen[id(phase)] = sorted(common, key=lambda name: (name != phase.owner, case.trained.index(name)))
        case.find_unused |= backend.needs_find_unused  # what a user of such a loss sets, as under DDP
        if all(chosen[id(phase)] == phase.steps for phase in case.phases):
            return case if any(phase.steps for phase in case.phases) else None
        for phase in case.phases:
            phase.steps = chosen[id(phase)]
    return None
