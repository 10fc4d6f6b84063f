"""The fuzzer's grammar: a case is what a user writes around ``MultiDeepSpeedStrategy``, drawn from a seed.

A :class:`Case` holds 1-4 small MLP submodules (each an engine: trained with its own optimizer, or frozen; one
may reuse another's first layer), their ZeRO stages and DeepSpeed options, an optional EMA engine, the
precision, the hooks that read gradients, a ``training_step`` written as a list of :class:`Phase` s, and an
optional :class:`Resume`: save, then resume in a new fit whose strategy differs. A phase backpropagates a loss (a sum of
:class:`Term` s, each a chain of submodule calls) once per micro-batch, then steps some optimizers.
Every dimension is a field with a plain default, so a case can be drawn (:func:`generate`), written as JSON
(:func:`to_json`, :func:`from_json`) and simplified one field at a time (:func:`simplifications`).

What :func:`generate` draws is limited by :class:`Switches`: the fixed slice in ``make test`` draws with
:data:`SAFE`, which leaves out the dimensions of the defects known today.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

EDIT_FACTOR = 0.9
"""What a phase's ``edit`` multiplies the owner's weights by."""
FEATURES = 4
"""Every submodule maps ``FEATURES`` inputs to ``FEATURES`` outputs, so any chain of calls composes."""
GLOBAL_BATCH = 8
WORLD_SIZE = 2
CHECKPOINTS = ("reentrant", "non_reentrant")


@dataclass
class Engine:
    """One submodule ``Linear(4, hidden), Tanh, Linear(hidden, 4)`` and its engine."""

    name: str
    hidden: int = 4
    optimizer: str | None = "sgd"
    """``"sgd"``, ``"adam"``, ``"adamw"`` (weight decay), ``"adafactor"`` (tensor-wise: refused at ZeRO-1/2/3), or None
    for a frozen engine (an ``engine_configs`` entry and no optimizer)."""
    stage: int = 0
    offload: bool = False
    """``offload_optimizer: {device: cpu}`` (torch's optimizer stepping on the CPU)."""
    fp32_grad_accum: bool = False
    """``data_types.grad_accum_dtype: fp32`` (bf16 at ZeRO-1: DeepSpeed's ``BF16_Optimizer``)."""
    inner_checkpoint: str | None = None
    """Its last two layers under ``torch.utils.checkpoint`` (``"reentrant"`` or ``"non_reentrant"``)."""
    shares: str | None = None
    """An earlier engine whose first layer this one reuses (the same ``nn.Linear``): refused at setup."""
    scalar: bool = False
    """A learned 0-dim scale after the MLP (CLIP's ``logit_scale``)."""
    freeze_at: int | None = None
    """From this training step on, its first layer is frozen (``requires_grad_(False)``): no gradient, left alone."""
    built_frozen: bool = False
    """Its first layer is built with ``requires_grad=False`` (a LoRA-style frozen base inside a trained engine)."""
    unfreeze_at: int | None = None
    """From this training step on, its first layer is unfrozen again (``requires_grad_(True)``), after ``freeze_at``
    or ``built_frozen``: one built frozen is refused at the next backward except at ZeRO-0 in fp32 (docs/errors.md)."""
    joins: str | None = None
    """An earlier trained engine whose optimizer also trains this submodule: one optimizer over both
    (``Adam([*self.e0.parameters(), *self.e2.parameters()])``), so one engine named by the earlier one and configured
    by its ``engine_configs`` entry. This one's optimizer, stage and options are the earlier one's."""

    @property
    def trained(self) -> bool:
        return self.optimizer is not None


@dataclass
class Call:
    """One call of a submodule in a chain, on the output of the previous call (or the term's source)."""

    engine: str
    detach: bool = False
    """``.detach()`` the input first (``D(fake.detach())``)."""
    no_grad: bool = False
    """Run the call under ``torch.no_grad()`` (a teacher's targets)."""
    checkpoint: str | None = None
    """Run the whole call under ``torch.utils.checkpoint`` (``"reentrant"`` or ``"non_reentrant"``)."""


@dataclass
class Term:
    """``weight * reduce(chain(source))``, where ``chain`` applies ``calls`` in order."""

    calls: list[Call]
    source: str = "x"
    """``"x"`` or ``"y"``: the batch's first or last ``FEATURES`` columns."""
    target: str = "zero"
    """``"zero"``: ``out.pow(2).mean()``; ``"y"``: ``(out - y).pow(2).mean()``; ``"half"``: ``(out - 0.5)...``."""
    weight: float = 1.0
    scale: str = "const"
    """``"data"``: times the mean absolute value of the rank's own batch (different on each rank)."""
    gate: str = "always"
    """``"first_step"``: only at ``batch_idx == 0``; ``"data"``: only where the rank's own batch has
    ``x[:, 0].sum() > 0`` (so on some ranks only)."""
    penalty: bool = False
    """Instead of ``reduce``: a gradient penalty ``(|d out.sum() / d source|^2 - 1)^2`` (``create_graph=True``)."""


@dataclass
class Phase:
    """Backpropagate ``sum(terms)`` per micro-batch, then step: one part of ``training_step``."""

    terms: list[Term]
    owner: str
    """The trained engine the phase is for: toggled, and stepped under ``step="owner"``."""
    step: str = "owner"
    """Which optimizers to step: ``"owner"`` or ``"reached"`` (every engine with gradients on every rank)."""
    steps: list[str] = field(default_factory=list)
    """The optimizers stepped, in order: filled from ``step`` by ``reference.resolve``."""
    micro: int = 1
    """Micro-batches: ``backward(loss(chunk) / micro)`` for each ``chunk`` of the rank's batch."""
    zero_grad: str = "after"
    """``"before"`` the first backward (the stepped engines), ``"after"`` the steps (the stepped engines),
    ``"between"`` the backwards and the steps (the other trained engines: their stray gradients), or ``"none"``."""
    toggle: bool = False
    """Run the phase inside ``self.toggled_optimizer(owner's optimizer)``."""
    no_sync: str = "off"
    """Run the backwards inside ``strategy.no_sync()``: ``"owner"`` (its engine) or ``"all"`` (every engine)."""
    shared: bool = False
    """Compute a chain prefix once per loss and reuse it: ``fake = G(z)``, then ``D(fake.detach())``, ``D(fake)``."""
    plain_backward: bool = False
    """``loss.backward()`` instead of ``self.manual_backward(loss)``."""
    clip: float = 0.0
    """Where the owner steps in the phase: ``self.clip_gradients(opt, gradient_clip_val=clip)`` (norm) before its
    step; 0: no clipping."""
    edit: str = "none"
    """After the phase, the owner's weights times :data:`EDIT_FACTOR`: ``"plain"`` (``p.data.mul_``), ``"inplace"``
    (``p.mul_`` under ``no_grad``; never at ZeRO-3, where it is a documented blind spot) or ``"block"`` (inside
    ``strategy.gathered(owner, modifier_rank=0)``, where rank 1 multiplies by another factor, dropped)."""
    drop_grad: bool = False
    """Between the backwards and the steps, ``p.grad = None`` on the owner's first weight (a gradient dropped by
    hand): refused at the write (docs/errors.md: ``param.grad`` between backward and step)."""
    reset_state: bool = False
    """After the steps, the owner's first weight's Adam moment reset by hand: ``state = opt.state[p]``, then
    ``state["exp_avg"].zero_()`` where it has one. Torch's own state at ZeRO-0 in fp32; refused at the touch
    elsewhere (DeepSpeed keeps it in flat partitions or beside fp32 copies)."""


@dataclass
class Ema:
    """``ema={average: (source, decay)}``: the submodule ``average`` (a copy of ``source``) follows its steps."""

    average: str
    source: str
    stage: int = 0
    decay: float = 0.5


@dataclass
class Resume:
    """Save after ``at`` training steps (``trainer.save_checkpoint`` when that fit ends), then resume from it in a new
    fit whose strategy differs as the other fields say. Each step is an epoch of one batch, so the resume starts at
    an epoch's beginning."""

    at: int = 1
    stages: dict[str, int] = field(default_factory=dict)
    """Engines at another ZeRO stage in the resumed fit (a trained one: refused, except ZeRO-1 <-> ZeRO-2)."""
    inside: str | None = None
    """Save inside ``strategy.gathered(inside)`` (at ``on_train_end``)."""
    drop_ema: bool = False
    """Resume without ``ema=``: the average is a plain submodule holding what was saved, and stops following."""
    drop_frozen: list[str] = field(default_factory=list)
    """Frozen engines resumed without their ``engine_configs`` entry: plain submodules then."""


@dataclass
class Case:
    """Everything one fuzz case trains: 2 ranks, ``steps`` batches of ``GLOBAL_BATCH`` samples."""

    seed: int
    engines: list[Engine]
    phases: list[Phase]
    precision: str = "32-true"
    ema: Ema | None = None
    read_after_backward: list[str] = field(default_factory=list)
    """Engines whose ``full_gradients`` ``on_after_backward`` reads, after every backward."""
    read_before_step: bool = False
    """``on_before_optimizer_step`` reads the ``full_gradients`` of the engine it steps."""
    steps: int = 2
    resume: Resume | None = None
    find_unused: bool = False
    """``MultiDeepSpeedStrategy(find_unused_parameters=True)``: drawn, and set where the case needs it (a backward that
    reaches an engine on some ranks only, or a ZeRO-2/3 engine in part; :func:`reference.resolve`)."""
    zero_grad_by: str = "optimizer"
    """How a phase clears an engine: ``"optimizer"`` (``opt.zero_grad()``) or ``"module"``
    (``self.<engine>.zero_grad()``, as PyTorch's DCGAN tutorial; each part's, for an optimizer over several)."""
    set_to_none: bool = True
    """``zero_grad(set_to_none=...)`` wherever the case clears: False leaves zeros, which ``torch.optim`` steps."""
    part_entries: bool = False
    """The submodules that join another's optimizer (``Engine.joins``) get ``engine_configs`` entries of their own
    too: refused at setup (the entry is the first part's)."""

    def engine(self, name: str) -> Engine:
        return next(engine for engine in self.engines if engine.name == name)

    @property
    def trained(self) -> list[str]:
        """The optimizers, named by their engines: every trained submodule but those that join another's."""
        return [engine.name for engine in self.engines if engine.trained and engine.joins is None]

    def parts(self, name: str) -> list[str]:
        """The submodules the optimizer ``name`` trains, in the module's order: ``name``, then those joining it."""
        return [name] + [engine.name for engine in self.engines if engine.joins == name]

    @property
    def module_names(self) -> list[str]:
        """Every submodule: the engines and the EMA average."""
        return [engine.name for engine in self.engines] + ([self.ema.average] if self.ema else [])


@dataclass(frozen=True)
class Switches:
    """Which dimensions :func:`generate` may draw; each one off leaves its field at the default."""

    max_engines: int = 4
    frozen: bool = True
    adam: bool = True
    stages: tuple[int, ...] = (0, 1, 2, 3)
    bf16: bool = True
    offload: bool = True
    fp32_grad_accum: bool = True
    inner_checkpoint: bool = True
    call_checkpoints: tuple[str, ...] = CHECKPOINTS
    detach: bool = True
    no_grad: bool = True
    penalty: bool = True
    rank_scale: bool = True
    gates: tuple[str, ...] = ("first_step", "data")
    micro: bool = True
    zero_grad: tuple[str, ...] = ("before", "after", "between", "none")
    toggle: bool = True
    no_sync: bool = True
    shared: bool = True
    plain_backward: bool = True
    read_after_backward: bool = True
    read_before_step: bool = True
    ema: bool = True
    shared_params: bool = True
    resume: bool = True
    touches: bool = True
    """Clipping before a step and weight edits after a phase (drawn last: a seed's case is otherwise the same)."""
    find_unused: bool = True
    """``find_unused_parameters=True`` where the case does not need it (drawn after everything else)."""
    torch_optim: bool = True
    """What ``torch.optim`` does per parameter: 0-dim parameters, layers frozen mid-fit, ``module.zero_grad()``, AdamW's
    weight decay and Adafactor (drawn after everything else, from a generator of their own)."""
    per_parameter: bool = True
    """More of it: optimizers over several submodules, layers built frozen or unfrozen mid-fit, ``zero_grad(
    set_to_none=False)``, ``p.grad = None`` before a step and ``opt.state`` edits (drawn after ``torch_optim``, from
    a generator of their own)."""


FULL = Switches()
BEFORE_RESUME = Switches(shared_params=False, resume=False, touches=False, torch_optim=False, per_parameter=False)
"""The grammar before shared layers and resumes were added: the seeds chosen then draw the same cases in it."""
SAFE = Switches(
    offload=False,  # known defect 2: ZeRO-2 + offload_optimizer keeps gradients that zero_grad() should drop
    fp32_grad_accum=False,  # known defect 3: full_gradients under BF16_Optimizer sees the last micro-backward only
    read_after_backward=False,  # known defect 1: on_after_backward runs before the engines' epilogues
    gates=("first_step",),  # known defect 4: a loss that reaches an engine on some ranks only
    plain_backward=False,  # known defect 5: loss.backward() beside manual_backward
    call_checkpoints=("non_reentrant",),  # known defect 6: an engine called plainly and in a reentrant checkpoint
    shared_params=False,  # drawn after the six defects' seeds were chosen: left out so those seeds draw alike
    resume=False,
    touches=False,
    torch_optim=False,
    per_parameter=False,
)
"""The dimensions of :data:`FULL` without those of the six defects known on 2026-11-24."""
SAFE_RESUMING = dataclasses.replace(SAFE, shared_params=True, resume=True)
""":data:`SAFE` with shared layers and resumes (stages changed, saves inside ``gathered``, engines dropped)."""
SAFE_TOUCHING = dataclasses.replace(SAFE_RESUMING, touches=True)
""":data:`SAFE_RESUMING` with clipping and weight edits."""
SAFE_OPTIM = dataclasses.replace(SAFE_TOUCHING, torch_optim=True, per_parameter=True)
""":data:`SAFE_TOUCHING` with what ``torch.optim`` does per parameter (0-dim scales, freezing and unfreezing,
``module.zero_grad()``, AdamW, Adafactor, optimizers over several submodules, ``set_to_none=False``, ``p.grad = None``,
``opt.state`` edits)."""
BEFORE_PER_PARAMETER = dataclasses.replace(SAFE_OPTIM, per_parameter=False)
""":data:`SAFE_OPTIM` before ``per_parameter`` existed: the seeds chosen then draw the same cases in it."""


def chance(rng: random.Random, p: float, allowed: bool = True) -> bool:
    return allowed and rng.random() < p


def draw_engines(rng: random.Random, switches: Switches) -> list[Engine]:
    count = rng.randint(1, switches.max_engines)
    engines = [draw_engine(rng, f"e{i}", switches) for i in range(count)]
    if not any(engine.trained for engine in engines):
        engines[0].optimizer = "sgd"
    return engines


def draw_engine(rng: random.Random, name: str, switches: Switches) -> Engine:
    engine = Engine(name, hidden=rng.randint(4, 8), stage=rng.choice(switches.stages))
    if chance(rng, 0.3, switches.frozen):
        engine.optimizer = None
    elif chance(rng, 0.4, switches.adam):
        engine.optimizer = "adam"
    engine.offload = engine.trained and engine.stage > 0 and chance(rng, 0.15, switches.offload)
    if chance(rng, 0.15, switches.inner_checkpoint):
        engine.inner_checkpoint = rng.choice(CHECKPOINTS)
    return engine


def draw_call(rng: random.Random, engine: str, switches: Switches, first: bool) -> Call:
    call = Call(engine)
    call.detach = not first and chance(rng, 0.15, switches.detach)
    call.no_grad = chance(rng, 0.1, switches.no_grad)
    if switches.call_checkpoints and chance(rng, 0.1):
        call.checkpoint = rng.choice(switches.call_checkpoints)
    return call


def draw_term(rng: random.Random, names: list[str], owner: str | None, switches: Switches) -> Term:
    """A chain of 1-3 calls; with ``owner``, the owner is among them and nothing after it cuts its gradient."""
    chain = [rng.choice(names) for _ in range(rng.randint(1, 3))]
    if owner is not None:
        chain[rng.randrange(len(chain))] = owner
    calls = [draw_call(rng, name, switches, first=i == 0) for i, name in enumerate(chain)]
    if owner is not None:
        at = chain.index(owner)
        calls[at].no_grad = False
        for call in calls[at + 1 :]:
            call.detach = call.no_grad = False
    term = Term(calls, source=rng.choice(("x", "y")), target=rng.choice(("zero", "y", "half")))
    term.weight = rng.choice((1.0, 0.5, 2.0))
    term.scale = "data" if chance(rng, 0.15, switches.rank_scale) else "const"
    if owner is None and switches.gates and chance(rng, 0.25):
        term.gate = rng.choice(switches.gates)
    term.penalty = chance(rng, 0.15, switches.penalty) and penalty_allowed(term)
    return term


def penalty_allowed(term: Term) -> bool:
    """A gradient penalty needs a chain that autograd can differentiate twice from its source."""
    return not any(call.detach or call.no_grad or call.checkpoint == "reentrant" for call in term.calls)


def draw_phase(rng: random.Random, case: Case, switches: Switches) -> Phase:
    names = [engine.name for engine in case.engines] + ([case.ema.average] if case.ema else [])
    owner = rng.choice(case.trained)
    terms = [draw_term(rng, names, owner, switches)]
    terms += [draw_term(rng, names, None, switches) for _ in range(rng.choice((0, 0, 1, 2)))]
    phase = Phase(terms, owner, step=rng.choice(("owner", "owner", "reached")))
    phase.micro = rng.choice((2, 3)) if chance(rng, 0.3, switches.micro) else 1
    phase.zero_grad = rng.choice(switches.zero_grad)
    phase.toggle = chance(rng, 0.3, switches.toggle)
    phase.no_sync = rng.choice(("owner", "all")) if chance(rng, 0.2, switches.no_sync) else "off"
    phase.shared = chance(rng, 0.3, switches.shared)
    phase.plain_backward = chance(rng, 0.05, switches.plain_backward)
    return phase


def draw_case(seed: int, rng: random.Random, switches: Switches) -> Case:
    """One draft case; ``reference.resolve`` decides the steps and whether it is valid."""
    case = Case(seed, draw_engines(rng, switches), [])
    case.precision = "bf16-mixed" if chance(rng, 0.3, switches.bf16) else "32-true"
    for engine in case.engines:
        bf16_optimizer = case.precision == "bf16-mixed" and engine.trained and engine.stage == 1 and not engine.offload
        engine.fp32_grad_accum = bf16_optimizer and chance(rng, 0.4, switches.fp32_grad_accum)
    if chance(rng, 0.15, switches.ema):
        case.ema = Ema("avg", rng.choice(case.trained), stage=rng.choice(switches.stages))
    case.phases = [draw_phase(rng, case, switches) for _ in range(rng.randint(1, 3))]
    if chance(rng, 0.2, switches.read_after_backward):
        case.read_after_backward = sorted(rng.sample(case.trained, rng.randint(1, len(case.trained))))
    case.read_before_step = chance(rng, 0.25, switches.read_before_step)
    draw_sharing(rng, case, switches)
    case.resume = draw_resume(rng, case, switches)
    for phase in case.phases:
        draw_touches(rng, case, phase, switches)
    # from a generator of its own: the main one draws what it drew before the option existed, seed for seed
    case.find_unused = chance(random.Random(f"find_unused {seed}"), 0.3, switches.find_unused)
    draw_torch_optim(random.Random(f"torch_optim {seed}"), case, switches)
    draw_per_parameter(random.Random(f"per_parameter {seed}"), case, switches)
    return case


def draw_torch_optim(rng: random.Random, case: Case, switches: Switches) -> None:
    """Maybe 0-dim scales, layers frozen mid-fit, ``module.zero_grad()``, AdamW or Adafactor.

    A frozen layer is not drawn beside ``toggle_optimizer`` (Lightning's toggle sets ``requires_grad`` back to True on
    the toggled optimizer's parameters) nor on a shared layer.
    """
    if not switches.torch_optim:
        return
    shared = {engine.shares for engine in case.engines if engine.shares}
    toggles = any(phase.toggle for phase in case.phases)
    for engine in case.engines:
        plain = engine.inner_checkpoint is None and engine.shares is None and engine.name not in shared
        engine.scalar = plain and chance(rng, 0.2)
        if not engine.trained:
            continue
        if plain and not toggles and case.steps > 1 and chance(rng, 0.15):
            engine.freeze_at = 1
        draw = rng.random()
        if draw < 0.15:
            engine.optimizer = "adamw"
        elif draw < 0.2:
            engine.optimizer = "adafactor"
    case.zero_grad_by = "module" if chance(rng, 0.3) else "optimizer"


def draw_per_parameter(rng: random.Random, case: Case, switches: Switches) -> None:
    """Maybe one optimizer over two submodules, a first layer built frozen or unfrozen mid-fit, ``set_to_none=False``,
    ``p.grad = None`` before a step, or ``opt.state`` edits after it.

    What is refused (docs/errors.md) is drawn less often than what trains: an unfreezing of a layer built frozen and
    a moment reset mostly at ZeRO-0 in fp32, where torch's optimizer holds the state, ``p.grad = None`` rarely, an
    ``engine_configs`` entry for the later part one time in ten, and the joining of an EMA's source one time in five.
    As for ``freeze_at``, no freezing beside ``toggle_optimizer`` nor on a shared layer; no joining of a shared
    layer's engines (the one parameter would be twice in one optimizer).
    """
    if not switches.per_parameter:
        return
    shared = {engine.shares for engine in case.engines if engine.shares}
    toggles = any(phase.toggle for phase in case.phases)
    fp32 = case.precision == "32-true"
    averaged = case.ema.source if case.ema is not None and not chance(rng, 0.2) else None  # refused: mostly not
    joinable = [e for e in case.engines if e.trained and e.shares is None and e.name not in shared | {averaged}]
    if len(joinable) >= 2 and chance(rng, 0.3):
        first, part = sorted(rng.sample(range(len(joinable)), 2))
        join(case, joinable[first], joinable[part])
        case.part_entries = chance(rng, 0.1)
    for engine in case.engines:
        plain = engine.inner_checkpoint is None and engine.shares is None and engine.name not in shared
        if not engine.trained or not plain or toggles:
            continue
        torch_state = engine.stage == 0 and fp32
        draw = rng.random()
        if draw < 0.08:
            engine.built_frozen = True  # a frozen base beside trained layers
        elif draw < (0.2 if torch_state else 0.11):
            engine.built_frozen, engine.unfreeze_at = True, 1
        elif draw < (0.3 if torch_state else 0.21) and engine.freeze_at is None:
            engine.freeze_at, engine.unfreeze_at = 0, 1  # frozen for the first step only
    case.set_to_none = not chance(rng, 0.3)
    for phase in case.phases:
        phase.drop_grad = chance(rng, 0.015)
        owner = case.engine(phase.owner)
        phase.reset_state = chance(rng, 0.3 if owner.stage == 0 and fp32 else 0.04)


def join(case: Case, first: Engine, part: Engine) -> None:
    """One optimizer over ``first`` and ``part`` (later in the module): ``part`` takes ``first``'s engine settings,
    and a phase for ``part`` becomes one for ``first``, the engine they form (its in-place edit one in a ``gathered``
    block where that is ZeRO-3, as :func:`draw_touches` draws them)."""
    part.joins = first.name
    part.optimizer, part.stage, part.offload = first.optimizer, first.stage, first.offload
    part.fp32_grad_accum = first.fp32_grad_accum
    if case.resume is not None:
        case.resume.stages.pop(part.name, None)
    stages = {first.stage, case.resume.stages.get(first.name, first.stage) if case.resume else first.stage}
    for phase in case.phases:
        if phase.owner == part.name:
            phase.owner = first.name
            phase.edit = "block" if phase.edit == "inplace" and 3 in stages else phase.edit


def draw_touches(rng: random.Random, case: Case, phase: Phase, switches: Switches) -> None:
    """Maybe clipping before the owner's step and an edit of its weights after the phase.

    A plain edit of a ZeRO-3 engine's weights (empty partitions between steps) is refused: at ZeRO-3, before or after
    a resume, the edit is mostly made in a ``gathered`` block, and plainly one time in five, for the refusal.
    """
    if chance(rng, 0.25, switches.touches):
        phase.clip = rng.choice((0.05, 0.5))
    if chance(rng, 0.3, switches.touches):
        stages = {case.engine(phase.owner).stage, case.resume.stages.get(phase.owner, 0) if case.resume else 0}
        draw = rng.random()
        if 3 in stages:
            phase.edit = "block" if draw < 0.8 else "plain"
        else:  # one draw, as before "inplace" existed: the rest of a seed's case stays what it was
            phase.edit = "block" if draw < 0.5 else "plain" if draw < 0.8 else "inplace"


def draw_sharing(rng: random.Random, case: Case, switches: Switches) -> None:
    """Maybe one engine reuses an earlier one's first layer (neither with an inner checkpoint)."""
    plain = [engine for engine in case.engines if engine.inner_checkpoint is None]
    if len(plain) >= 2 and chance(rng, 0.1, switches.shared_params):
        first, second = sorted(rng.sample(range(len(plain)), 2))
        plain[second].shares = plain[first].name


def draw_resume(rng: random.Random, case: Case, switches: Switches) -> Resume | None:
    """Maybe save after some steps and resume with stages changed, inside a block, or engines dropped."""
    if case.steps < 2 or not chance(rng, 0.25, switches.resume):
        return None
    resume = Resume(at=rng.randint(1, case.steps - 1))
    for engine in case.engines:
        if not engine.offload and not engine.fp32_grad_accum and chance(rng, 0.2):
            resume.stages[engine.name] = rng.choice([s for s in switches.stages if s != engine.stage] or [0])
    if chance(rng, 0.3):
        resume.inside = rng.choice(case.module_names)
    resume.drop_ema = case.ema is not None and chance(rng, 0.3)
    resume.drop_frozen = [engine.name for engine in case.engines if not engine.trained and chance(rng, 0.3)]
    return resume


def generate(seed: int, switches: Switches = FULL, valid: Callable[[Case], Case | None] | None = None) -> Case:
    """The case of ``seed``: the first draft that ``valid`` accepts (returning it resolved), drawn from ``seed``.

    Without ``valid`` the first draft, unresolved.
    """
    rng = random.Random(seed)
    for _ in range(50):
        case = draw_case(seed, rng, switches)
        resolved = valid(case) if valid is not None else case
        if resolved is not None:
            return resolved
    raise RuntimeError(f"seed {seed}: no valid case in 50 drafts")


# ---- JSON ------------------------------------------------------------------------------------------------


def to_dict(case: Case) -> dict[str, Any]:
    return dataclasses.asdict(case)


def to_json(case: Case) -> str:
    return json.dumps(to_dict(case), sort_keys=True)


def from_dict(data: dict[str, Any]) -> Case:
    phases = [
        Phase(**{**p, "terms": [Term(**{**t, "calls": [Call(**c) for c in t["calls"]]}) for t in p["terms"]]})
        for p in data["phases"]
    ]
    ema = Ema(**data["ema"]) if data.get("ema") else None
    engines = [Engine(**e) for e in data["engines"]]
    resume = Resume(**data["resume"]) if data.get("resume") else None
    return Case(**{**data, "engines": engines, "phases": phases, "ema": ema, "resume": resume})


def from_json(text: str) -> Case:
    return from_dict(json.loads(text))


# ---- simplification (for the shrinker) -------------------------------------------------------------------

JOINED_SETTINGS = ("optimizer", "stage", "offload", "fp32_grad_accum")
"""An engine's settings that the submodules joining its optimizer (``Engine.joins``) share."""

Path = tuple[str | int, ...]
"""Where an edit acts, from the case: ``("phases", 0, "terms", 1)`` is ``case.phases[0].terms[1]``."""


def _at(case: Case, path: Path) -> Any:
    target: Any = case
    for part in path:
        target = target[part] if isinstance(part, int) else getattr(target, part)
    return target


@dataclass(frozen=True)
class SetField:
    """Set ``key`` of the object at ``path`` to ``value`` (a simpler one)."""

    path: Path
    key: str
    value: Any

    def apply(self, case: Case) -> bool:
        target = _at(case, self.path)
        if target is None or getattr(target, self.key) == self.value:
            return False
        if self.path == () and self.key == "ema" and case.ema is not None and case.ema.average in _referred(case):
            return False  # a call still runs the average: drop those first
        setattr(target, self.key, copy.deepcopy(self.value))
        if self.key == "precision":  # DeepSpeed's BF16_Optimizer exists in bf16 only
            for engine in case.engines:
                engine.fp32_grad_accum = False
        if self.key == "stage" and self.path[0] == "engines":
            target.offload = target.offload and self.value > 0
        if self.path[:1] == ("engines",) and self.key in JOINED_SETTINGS:  # the parts joining it: its settings
            for engine in case.engines:
                if engine.joins == target.name:
                    setattr(engine, self.key, getattr(target, self.key))
                    engine.offload = target.offload
        return True

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.path)) or 'case'}: {self.key}={self.value!r}"


@dataclass(frozen=True)
class Drop:
    """Remove item ``index`` of the list at ``path`` (keeping at least one)."""

    path: Path
    index: int

    def apply(self, case: Case) -> bool:
        items = _at(case, self.path)
        if len(items) <= 1:
            return False
        del items[self.index]
        return True

    def __str__(self) -> str:
        return f"drop {'.'.join(map(str, self.path))}[{self.index}]"


@dataclass(frozen=True)
class DropEngine:
    """Remove an engine that no call, phase, hook or average refers to."""

    name: str

    def apply(self, case: Case) -> bool:
        if self.name in _referred(case) or len(case.engines) == 1:
            return False
        case.engines = [engine for engine in case.engines if engine.name != self.name]
        if case.resume is not None:
            case.resume.stages.pop(self.name, None)
            case.resume.drop_frozen = [name for name in case.resume.drop_frozen if name != self.name]
        return True

    def __str__(self) -> str:
        return f"drop engine {self.name}"


def _referred(case: Case) -> set[str]:
    """The submodules (engines and the average) that a call, phase, hook, average, share or resume refers to."""
    used = {call.engine for phase in case.phases for term in phase.terms for call in term.calls}
    used |= {phase.owner for phase in case.phases} | set(case.read_after_backward)
    used |= {case.ema.source} if case.ema else set()
    used |= {engine.shares for engine in case.engines if engine.shares}
    used |= {engine.joins for engine in case.engines if engine.joins}
    used |= {case.resume.inside} if case.resume and case.resume.inside else set()
    return used


Edit = SetField | Drop | DropEngine

PHASE_DEFAULTS = {"micro": 1, "toggle": False, "no_sync": "off", "shared": False, "plain_backward": False}
PHASE_DEFAULTS |= {"zero_grad": "after", "step": "owner", "clip": 0.0, "edit": "none"}
PHASE_DEFAULTS |= {"drop_grad": False, "reset_state": False}
TERM_DEFAULTS = {"penalty": False, "gate": "always", "scale": "const", "weight": 1.0, "target": "zero", "source": "x"}
CALL_DEFAULTS = {"detach": False, "no_grad": False, "checkpoint": None}
ENGINE_DEFAULTS = {"offload": False, "fp32_grad_accum": False, "inner_checkpoint": None, "shares": None, "hidden": 4}
ENGINE_DEFAULTS |= {"scalar": False, "freeze_at": None, "built_frozen": False, "unfreeze_at": None, "joins": None}
RESUME_DEFAULTS = {"stages": {}, "inside": None, "drop_ema": False, "drop_frozen": []}


def simplifications(case: Case) -> Iterator[tuple[str, Case]]:
    """Every case one edit simpler than ``case`` (unresolved), biggest edits first, each with a description."""
    for edit in edits(case):
        simpler = copy.deepcopy(case)
        if edit.apply(simpler):
            yield str(edit), simpler


def edits(case: Case) -> Iterator[Edit]:
    yield from _removals(case)
    yield SetField((), "resume", None)
    yield SetField((), "steps", 1)
    yield SetField((), "ema", None)
    yield SetField((), "precision", "32-true")
    yield SetField((), "read_before_step", False)
    yield SetField((), "zero_grad_by", "optimizer")
    yield SetField((), "part_entries", False)
    yield SetField((), "set_to_none", True)
    yield SetField((), "read_after_backward", [])
    if len(case.read_after_backward) > 1:
        yield SetField((), "read_after_backward", case.read_after_backward[:1])
    yield SetField(("ema",), "stage", 0)
    if case.resume is not None:
        yield from _defaults(("resume",), RESUME_DEFAULTS)
    for i, phase in enumerate(case.phases):
        yield from _defaults(("phases", i), PHASE_DEFAULTS)
        if phase.micro == 3:
            yield SetField(("phases", i), "micro", 2)
        for j, term in enumerate(phase.terms):
            yield from _defaults(("phases", i, "terms", j), TERM_DEFAULTS)
            for k in range(len(term.calls)):
                yield from _defaults(("phases", i, "terms", j, "calls", k), CALL_DEFAULTS)
    for index, engine in enumerate(case.engines):
        yield from _defaults(("engines", index), ENGINE_DEFAULTS)
        if engine.trained:
            yield SetField(("engines", index), "optimizer", "sgd")
        yield from (SetField(("engines", index), "stage", stage) for stage in range(engine.stage))


def _removals(case: Case) -> Iterator[Edit]:
    for i, phase in enumerate(case.phases):
        yield Drop(("phases",), i)
        for j, term in enumerate(phase.terms):
            yield Drop(("phases", i, "terms"), j)
            yield from (Drop(("phases", i, "terms", j, "calls"), k) for k in range(len(term.calls)))
    yield from (DropEngine(engine.name) for engine in case.engines)


def _defaults(path: Path, defaults: dict[str, Any]) -> Iterator[Edit]:
    return (SetField(path, key, value) for key, value in defaults.items())
