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
from tests.fuzz.grammar import EDIT_FACTOR, JOINED_SETTINGS, WORLD_SIZE, Case, Engine, Phase

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
        trained = {engine.name for engine in case.engines if engine.trained}  # the parts of joined optimizers too
        for name in case.module_names:
            if name not in trained:
                modules[name].requires_grad_(False)
        self.params = {name: program.optimizer_params(case, modules, name) for name in case.trained}
        """What each optimizer holds: its submodule's parameters, and those of the submodules joining it."""
        self.optimizers = {
            name: program.make_optimizer(str(case.engine(name).optimizer), self.params[name]) for name in case.trained
        }
        self.stages = {engine.name: engine.stage for engine in case.engines}
        """Each engine's ZeRO stage in the fit running now (a resume may change it)."""
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
        self.got: dict[str, set[int]] = {name: set() for name in case.trained}
        """Each optimizer's parameters (by index) that a backward gave a gradient since its last step or zero_grad."""
        self.wanted: list[tuple[Phase, list[str]]] = []
        """Per phase run, the optimizers its ``step`` policy asks for (see :func:`resolve`)."""
        self.needs_find_unused = False
        """Whether a backward reaches an engine on some ranks only, or a ZeRO-2/3 engine in part."""
        self._now: dict[str, set[int]] = {}
        self._hooked: set[tuple[str, int]] = set()
        self._hook_new()

    def _hook_new(self) -> None:
        """Note each gradient arriving at a parameter that requires one now (a layer unfrozen since: from now on).

        A layer shared with a frozen engine is frozen (the strategy refuses the case): it is never hooked.
        """
        for name in self.case.trained:
            for index, p in enumerate(self.params[name]):
                if p.requires_grad and (name, index) not in self._hooked:  # a layer two engines share: for each
                    p.register_hook(lambda grad, name=name, index=index: self._arrived(name, index))
                    self._hooked.add((name, index))

    def _arrived(self, name: str, index: int) -> None:
        self.reached[name].add(self.rank)
        self.entered.add(self.rank)
        self._now.setdefault(name, set()).add(index)

    def _note_reach(self, per_rank: list[dict[str, set[int]]]) -> None:
        """What one backward reached on each rank: does the strategy need ``find_unused_parameters=True``?"""
        for name in self.case.trained:
            reaching = [now[name] for now in per_rank if now.get(name)]
            trained = {i for i, p in enumerate(self.params[name]) if p.requires_grad}
            partial = self.stages[name] >= 2 and any(trained - now for now in reaching)
            self.needs_find_unused |= partial or 0 < len(reaching) < len(per_rank)

    def _refuse_dropped(self, per_rank: list[dict[str, set[int]]]) -> None:
        """A backward that reaches a ZeRO-3 engine while a parameter of it is frozen and holds an earlier backward's
        gradient since the last clear: the strategy refuses it (ZeRO-3 would drop that gradient), so the case is
        left out of the grammar, as invalid (tests/distributed/test_torch_optim.py tests the refusal)."""
        for name in self.case.trained:
            got = [now[name] for now in per_rank if name in now]
            if got and self.stages[name] == 3:
                frozen = {i for i, p in enumerate(self.params[name]) if not p.requires_grad}
                if frozen & self.got[name]:
                    raise InvalidCase(f"{name} (ZeRO-3) reached while a frozen parameter holds a gradient")
            self.got[name] |= set().union(*got)

    def backward(self, loss_of: program.LossOf, plain: bool) -> None:
        self._hook_new()
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
        self._refuse_dropped(per_rank)
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
        for p in self.params[name]:  # docs/limitations.md: without find_unused_parameters a ZeRO-0/1
            if p.grad is None and p.requires_grad and not self.case.find_unused:  # engine steps what no rank's
                p.grad = torch.zeros_like(p)  # backward reached with a zero gradient; torch.optim skips it otherwise
        engine = self.case.engine(name)
        if self.stages[name] > 0 and engine.optimizer in ("adam", "adamw"):
            share_step_count(self.optimizers[name], self.engine_steps.get(name, 0))
        self.engine_steps[name] = self.engine_steps.get(name, 0) + 1
        self.optimizers[name].step()
        self._clear(name, set_to_none=True)  # the strategy's opt.step() clears the gradients it applied, as DeepSpeed's
        ema = self.case.ema
        if ema is not None and ema.source == name and self.following:
            move_towards(self.modules[ema.average], self.modules[name], 1.0 if not self.averaged else 1 - ema.decay)
            self.averaged += 1

    def zero_grad(self, name: str) -> None:
        """``opt.zero_grad(set_to_none=...)``, or ``zero_grad`` of each submodule it trains (the same here).

        Of a part of an engine over several submodules while the engine holds gradients the strategy refuses it
        (docs/errors.md: one flat partition for the whole engine): left out of the grammar, as invalid.
        """
        if self.case.zero_grad_by == "module" and len(self.case.parts(name)) > 1 and self.reached[name]:
            raise InvalidCase(f"zero_grad() of a part of {name}'s engine while it holds gradients")
        self._clear(name, self.case.set_to_none)

    def _clear(self, name: str, set_to_none: bool) -> None:
        self.optimizers[name].zero_grad(set_to_none=set_to_none)
        self.reached[name].clear()
        self.got[name].clear()

    def drop_gradient(self, name: str) -> None:
        next(self.modules[name].parameters()).grad = None

    def reset_state(self, name: str) -> None:
        state = self.optimizers[name].state[next(self.modules[name].parameters())]
        if "exp_avg" in state:
            state["exp_avg"].zero_()

    @contextlib.contextmanager
    def toggled(self, name: str) -> Iterator[None]:
        """Lightning's ``toggle_optimizer``: only ``name``'s optimizer's parameters require gradients."""
        saved = {p: p.requires_grad for n in self.case.trained for p in self.params[n]}
        for p in saved:
            p.requires_grad_(False)
        for p in self.params[name]:
            p.requires_grad_(saved[p])
        try:
            yield
        finally:
            for p, flag in saved.items():
                p.requires_grad_(flag)

    def no_sync(self, names: list[str]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the same mathematics with or without it

    def clip(self, name: str, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.params[name], max_norm)  # the averaged gradients, as DDP's

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
                backend._clear(name, set_to_none=True)
            backend.following = not case.resume.drop_ema
            backend.stages |= case.resume.stages
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
    step on each side of the save, and names what the case has. An engine joining another's optimizer does so
    with its settings; no in-place edit of a ZeRO-3 engine's weights outside ``gathered`` (a documented blind spot)."""
    if not all(
        not e.fp32_grad_accum or (case.precision == "bf16-mixed" and e.stage == 1 and not e.offload)
        for e in case.engines
    ):
        return False
    names = [engine.name for engine in case.engines]
    if any(e.shares is not None and e.shares not in names[: names.index(e.name)] for e in case.engines):
        return False
    if not all(joins_well(case, engine, names[: names.index(engine.name)]) for engine in case.engines):
        return False
    resumed = case.resume.stages if case.resume is not None else {}
    in_place = [phase.owner for phase in case.phases if phase.edit == "inplace"]
    if any(3 in {case.engine(name).stage, resumed.get(name)} for name in in_place):  # docs/module.md: not seen at
        return False  # ZeRO-3 outside `gathered` (a documented blind spot)
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


def joins_well(case: Case, engine: Engine, earlier: list[str]) -> bool:
    """An engine that joins another's optimizer: a trained one, after it, with its settings, sharing no layer."""
    if engine.joins is None:
        return True
    if engine.joins not in earlier or engine.shares is not None:
        return False
    first = case.engine(engine.joins)
    return (
        first.joins is None
        and first.trained
        and all(getattr(engine, key) == getattr(first, key) for key in JOINED_SETTINGS)
        and not any(other.shares in (engine.name, first.name) for other in case.engines)
    )


def no_sync_engines(case: Case, phase: Phase) -> list[str]:
    """The engines a phase's backwards run inside ``no_sync`` for: its owner's, or every trained one."""
    names = program.no_sync_names(case, phase)
    return case.trained if names == [] else names or []


PARTITIONED = r"\(ZeRO-3\) was (read|set) outside"


def refusal(case: Case) -> str | None:
    """What the strategy must refuse in ``case``, as a pattern of its message; None where it must train.

    At setup: two engines sharing a layer (a frozen engine's layer in another's optimizer: one optimizer over both
    submodules, whose entry for the later one is refused); an ``engine_configs`` entry for a later part of an engine
    over several submodules, or an EMA of such an engine; Adafactor (tensor-wise) at ZeRO-1/2/3. Then, in the order
    the fit meets them (those of one fit as alternatives): a plain edit (``p.data``) of a ZeRO-3 engine's weights, a
    plain ``loss.backward()``, a gradient penalty through a ZeRO-3 engine, ``full_gradients`` of a ZeRO-2 engine with
    ``offload_optimizer`` or of a ZeRO-2/3 engine inside ``no_sync``, ``p.grad = None`` between backward and step,
    ``opt.state[p]`` where DeepSpeed keeps the state (ZeRO-1/2/3, bf16), a layer built frozen and unfrozen there (at
    the next backward); a resume that changes a trained engine's ZeRO stage other than between 1 and 2 (DeepSpeed
    cannot load the optimizer state), at load; then what the resumed fit meets.
    """
    setup = setup_refusals(case)
    if setup:
        return "|".join(setup)
    stages = {engine.name: engine.stage for engine in case.engines}
    resume = case.resume
    first = fit_refusals(case, stages, 0, resume.at if resume is not None else case.steps)
    if first or resume is None:
        return "|".join(first) or None
    for name, stage in resume.stages.items():
        engine = case.engine(name)
        if engine.trained and stage != engine.stage and {stage, engine.stage} != {1, 2}:
            return "DeepSpeed cannot load its optimizer state into another stage"
    return "|".join(fit_refusals(case, stages | resume.stages, resume.at, case.steps)) or None


def setup_refusals(case: Case) -> list[str]:
    found = []
    if any(engine.shares for engine in case.engines):  # two optimizers holding it are refused first
        found.append("share a parameter|is in optimizer [0-9] and optimizer [0-9]")
        found.append(r"has an entry for '\w+', which one optimizer trains with")  # a frozen engine's layer
    joined = {name for name in case.trained if len(case.parts(name)) > 1}
    if case.part_entries and joined:
        found.append(r"`engine_configs` has an entry for '\w+', which one optimizer trains with")
    if case.ema is not None and any(case.ema.source in case.parts(name) for name in joined):
        found.append(r"averages '\w+', which one optimizer trains with")
    if any(case.engine(name).optimizer == "adafactor" and case.engine(name).stage > 0 for name in case.trained):
        found.append(r"runs ZeRO-\d, where DeepSpeed steps its optimizer .* over flat partitions")
    return found


def fit_refusals(case: Case, stages: dict[str, int], start: int, end: int) -> list[str]:
    """What a fit of the training steps ``start`` to ``end`` refuses, its engines at ``stages``."""
    found = []
    if any(stages[phase.owner] == 3 for phase in case.phases if phase.edit == "plain"):
        found.append(PARTITIONED)
    if any(phase.plain_backward for phase in case.phases):  # README: a plain loss.backward() reaching an engine
        found.append(r"backward outside `self.manual_backward`|was called with no gradient since its last step")
    through = {case.ema.average: case.ema.stage} if case.ema is not None else {}
    penalties = [term for phase in case.phases for term in phase.terms if term.penalty]
    if any((stages | through)[call.engine] == 3 for term in penalties for call in term.calls):
        found.append(r"A backward with `create_graph=True` .* runs through engine '\w+' \(ZeRO-3\)")
    read = set(case.read_after_backward) | {n for p in case.phases for n in p.steps if case.read_before_step}
    if any(stages[name] == 2 and case.engine(name).offload for name in read):
        found.append(r"`full_gradients\('\w+'\)` cannot read the ZeRO-2 engine '\w+' with `zero_optimization.offload")
    in_blocks = {name for phase in case.phases if phase.no_sync != "off" for name in no_sync_engines(case, phase)}
    read_engines = {case.engine(name).joins or name for name in case.read_after_backward}  # a part: its engine's
    if any(stages[name] >= 2 for name in in_blocks & read_engines):
        found.append(r"`full_gradients\('\w+'\)` inside `strategy.no_sync\(...\)`")
    if any(phase.drop_grad for phase in case.phases):
        found.append(r"`param\.grad` of a parameter of engine '\w+' \(ZeRO-\d\) was set between the backward")

    def deepspeed_state(name: str) -> bool:
        return stages[name] > 0 or case.precision != "32-true"

    if any(phase.reset_state and deepspeed_state(phase.owner) for phase in case.phases):
        found.append(r"`opt\.state\[param\]` of engine '\w+': DeepSpeed keeps this optimizer's state")
    if any(
        engine.trained
        and engine.built_frozen
        and engine.unfreeze_at is not None
        and max(start, engine.unfreeze_at) < end
        and deepspeed_state(engine.name)
        for engine in case.engines
    ):
        found.append(r"had `requires_grad=False` when the engine was built and requires a gradient now")
    return found


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
