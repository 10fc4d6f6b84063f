"""Route one ``loss.backward()`` through the backward prologue and epilogue of every engine it reaches.

DeepSpeed drives a backward with two pieces of per-engine state machinery:

* the *prologue* (what ``engine.backward`` runs before autograd): enter the ZeRO optimizer's backward
  context, set the accumulation boundary on the optimizer, queue a post-backward callback;
* the *epilogue* (what it runs after): reduce (stage 0/1 at the boundary) or
  finish reducing (stage 2/3) the gradients, then leave the backward context.

Left to itself, DeepSpeed runs the prologue from tensor hooks that ``engine.forward`` registers on
every output and the epilogue from an autograd callback. That is correct for one forward per engine
per backward, and wrong for the patterns people write in GANs (DeepSpeed 0.19, measured):

* an engine called twice before one backward (``D(real)``, ``D(fake)``) runs the prologue twice,
  its backward depth reaches 2 and the epilogue is skipped: nothing is reduced;
* a loss that flows through a second trained engine (``D(G(z))`` backpropagated for ``G``) reduces
  ``D``'s gradients without ``D``'s epilogue, so ``D``'s next backward fails;
* a chained loss divides ``G``'s gradients by the accumulation steps once per engine it crosses.

So the strategy takes explicit control instead. Submodules are called directly (never through
``engine.forward``), which registers no output hooks and no per-forward prologue. :meth:`Router.routed`
runs ``loss.backward()`` once. A hook on the loss, the first thing that backward runs, asks autograd which of
the trainable parameters' gradient accumulators (held since setup, :meth:`Router.watch`) it will run: each
engine with a reached parameter runs its prologue then, exactly once, before any of its gradients reaches
ZeRO's own hooks; after the backward each entered engine runs its epilogue exactly once, in name order (the
same collective order on every rank). The prologue runs no collective, so the order in which engines are
entered does not matter. Nothing walks the graph and no Python runs per parameter; only a loss scale that
depends on which engines the loss reaches (fp16 engines at different scales) needs the walk of
:mod:`lightning_multids._discovery`, whose engines are then entered first. Per-parameter tensor hooks
(:meth:`Router._gradient_hook`) see what the query cannot: the parameters inside a reentrant activation
checkpoint, which join the graph in the checkpoint's nested backward; with ``find_unused_parameters=True``
they record every arrival, for the ranks to compare after the backward (:func:`agree`).
Marking each engine as "inside engine.backward" tells DeepSpeed's own post-backward callback to leave
the epilogue to us, exactly as ``DeepSpeedEngine.backward`` does for itself.
The DeepSpeed calls themselves (prologue, epilogue, the marks) are in :mod:`lightning_multids._compat.deepspeed`.
What still comes from DeepSpeed's hooks: the ZeRO per-parameter gradient hooks (bucketing and
reduce-scatter at stage 2/3) and the ZeRO-3 module hooks that gather and release parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from torch.utils.hooks import RemovableHandle

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.torch import (
    ForwardCounter,
    accumulates_into,
    current_graph_task_id,
    gradient_accumulator,
    queue_callback,
    will_execute,
)
from lightning_multids._discovery import REENTRANT, UNWALKED, Reach
from lightning_multids._joined import called_modules


@dataclass
class _Phases:
    """Where one engine is in a routed backward: gradients not yet reduced, and nested graph tasks closed.

    ``task`` is the graph task whose gradients are pending; ``reduced`` says that some were reduced before the
    epilogue (a phase closed); ``arrived`` maps the index of each parameter whose gradient arrived to the order of
    its first arrival (1, 2, ...): ZeRO-2 buckets gradients in that order.
    """

    pending: bool = False
    ended: set[int] = field(default_factory=set)
    task: int = -1
    reduced: bool = False
    arrived: dict[int, int] = field(default_factory=dict)


@dataclass
class Route:
    """One routed backward: every trainable engine by name, and the ones entered so far.

    Engines are entered (prologue) when the backward starts and asks autograd what it reaches (or, with
    per-parameter hooks, when their first gradient arrives), or before the backward when a walk of the graph found
    them; epilogues run after it in name order. Every rank runs the same code on the
    same graph, so every rank enters the same engines and runs their epilogues (collectives at ZeRO-2/3) in
    the same order.
    """

    engines: Mapping[str, DeepSpeedEngine]
    factors: Mapping[str, float] = field(default_factory=dict)
    """Each engine's gradient factor (fp16 engines at different loss scales, :func:`precision.loss_scaling`)."""
    sizes: Mapping[str, int] = field(default_factory=dict)
    """Each engine's number of parameters (:meth:`Router.watch`), for :func:`agree`."""
    entered: dict[str, _Phases] = field(default_factory=dict)
    agreeing: bool = False
    """Whether the ranks agree on the reach after the backward (``find_unused_parameters=True``, :func:`agree`)."""
    several_ranks: bool = False
    """Whether other ranks run the same backward (a process group of more than one)."""
    hooked: set[str] = field(default_factory=set)
    """The engines whose parameters' hooks see this backward's gradients arrive (per-parameter reach and phases)."""
    unreached: dict[str, list[int]] = field(default_factory=dict)
    """Each entered engine's trained parameters (by index) that the backward does not reach, where there are some."""
    missing: dict[str, list[int]] = field(default_factory=dict)
    """Each entered engine's parameters (by index) that got no gradient from the backward on any rank, where there
    are some: left as they are by the engine's next step, as ``torch.optim`` leaves a parameter whose gradient is
    None (:meth:`EngineRecord.note_reach`). Known on every rank alike: agreed (``find_unused_parameters``), in one
    process, or frozen since setup (``requires_grad=False``); see :meth:`note_missing`."""
    handles: list[RemovableHandle] = field(default_factory=list)
    """Hooks registered for this backward only, removed after it."""
    root_task: int = -1
    ran: bool = False
    """Whether the body ran a backward through the loss (a ``LightningModule.backward`` override may skip it)."""

    def enter(self, name: str) -> _Phases:
        """Run ``name``'s prologue and mark it as inside a backward (``ds_compat.enter_backward``)."""
        phases = self.entered[name] = _Phases()
        ds_compat.enter_backward(self.engines[name])
        return phases

    def finish(self) -> None:
        """Run the epilogue of every entered engine, in name order, after a backward that completed.

        With several ranks, they first agree on what each one's backward reached (:func:`agree`): an engine
        reached on some ranks only, or whose parameters differ between ranks, is entered where it was not
        and evened out (:meth:`_even_out`) so that every rank runs the same reductions.
        At ZeRO-2, when every gradient was already reduced at the end of a nested phase (an engine wholly
        inside a reentrant checkpoint), the epilogue runs without its reduction: ZeRO-2 cannot reduce an
        empty bucket.
        """
        uneven = agree(self) if self.agreeing else set()
        if not self.agreeing:
            self._fill_unreached()
            for name in self.hooked & set(self.entered):
                arrived = self.entered[name].arrived
                self.note_missing(name, [index in arrived for index in range(self.sizes.get(name, 0))])
        for name in sorted(self.entered):
            engine, phases = self.engines[name], self.entered[name]
            if name in uneven:
                self._even_out(name, engine, phases)
                continue
            nothing_left = bool(phases.ended) and not phases.pending
            stage2_done = nothing_left and engine.zero_optimization_stage() == 2 and not ds_compat.in_no_sync(engine)
            ds_compat.end_backward(engine, reduce=not stage2_done)

    def note_missing(self, name: str, got: list[bool]) -> None:
        """Record in :attr:`missing` the parameters of ``name`` that this rank's backward gave no gradient (``got``).

        On several ranks without agreement, only those that require no gradient now (frozen since setup) count:
        another rank's backward may have reached the others, and they are stepped with the zero gradients their
        engine fills in (ZeRO-0/1; ZeRO-2/3 refuse such a reach), so every rank steps alike.
        """
        params = self.engines[name].module.parameters()
        missing = [
            index
            for index, (param, hit) in enumerate(zip(params, got, strict=False))
            if not hit and (not self.several_ranks or not param.requires_grad)
        ]
        if missing:
            self.missing[name] = missing

    def _fill_unreached(self) -> None:
        """Without agreement: give the unreached trained parameters of an entered ZeRO-0/1 engine zero gradients.

        Every rank then reduces every parameter (ZeRO-0's reduction fills them itself; ZeRO-1's would skip them), so
        ranks whose reach differs inside an engine still reduce alike, with no collective of the router's own. A
        ZeRO-2/3 engine buckets its gradients in arrival order, which only agreement can even out: refused.
        """
        if self.hooked:
            hooked = {name: missing for name in self.hooked & set(self.entered) if (missing := self._not_arrived(name))}
            self.unreached = {**self.unreached, **hooked}
            self.refuse_unreached()
        for name in sorted(self.unreached):
            if self.engines[name].zero_optimization_stage() == 1:
                ds_compat.fill_missing_gradients(self.engines[name])

    def refuse_unreached(self) -> None:
        """Without agreement: refuse a ZeRO-2/3 engine that the loss reaches in part (see :meth:`_fill_unreached`).

        Not in one process, where there is no other rank to mix gradients with.
        """
        if not self.several_ranks:
            return
        for name in sorted(self.unreached):
            engine = self.engines[name]
            if engine.zero_optimization_partition_gradients():
                _refuse_unreached(name, engine, self.unreached[name])

    def _not_arrived(self, name: str) -> list[int]:
        arrived = self.entered[name].arrived
        params = self.engines[name].module.parameters()
        return [index for index, param in enumerate(params) if param.requires_grad and index not in arrived]

    def _even_out(self, name: str, engine: DeepSpeedEngine, phases: _Phases) -> None:
        """End the backward of an engine whose reach differs between ranks, as DDP does: zeros where unreached.

        Every parameter without a gradient gets a zero one. At ZeRO-0/1 (and inside ``no_sync``) nothing is
        reduced before ``step()`` (or the block's end), which then reduces every parameter on every rank. At
        ZeRO-2/3 the buckets, filled in the order the gradients arrived on each rank, are emptied back into the
        gradients, which are then reduced in the engine's own parameter order, with DeepSpeed's flush.
        """
        if not engine.zero_optimization_partition_gradients() or ds_compat.in_no_sync(engine):
            ds_compat.fill_missing_gradients(engine)
            ds_compat.end_backward(engine)
            return
        ds_compat.take_back_bucketed_gradients(engine)
        ds_compat.fill_missing_gradients(engine)
        ds_compat.end_backward(engine, reduce=False)
        ds_compat.reduce_local_gradients(engine)

    def abandon(self) -> None:
        """After an exception: reset every entered engine and drop its gradients of this step (no collective)."""
        for name in sorted(self.entered):
            ds_compat.abandon_backward(self.engines[name])

    def leave(self) -> None:
        """Take every entered engine out of the backward, whether or not it completed."""
        for name in self.entered:
            ds_compat.leave_backward(self.engines[name])


@dataclass
class _Watched:
    """One trainable engine's parameters and their gradient accumulators, held from setup to teardown."""

    name: str
    engine: DeepSpeedEngine
    params: list[torch.nn.Parameter]
    nodes: list[Any]
    """The gradient accumulator of each parameter in ``indices``: :data:`will_execute` tells which a backward runs."""
    indices: list[int]
    late: list[int]
    """The parameters that did not require a gradient at setup: held once they do."""

    def hold_late(self) -> None:
        """Hold the accumulators of the parameters that started to require a gradient since setup."""
        if not any(self.params[index].requires_grad for index in self.late):
            return
        for index in [index for index in self.late if self.params[index].requires_grad]:
            self.nodes.append(ds_compat.gradient_accumulator(self.params[index]))
            self.indices.append(index)
            self.late.remove(index)

    def hold_again_if_replaced(self) -> None:
        """Hold the accumulators again where torch replaced them (a change of the parameters' dtype or device).

        Checked on the first parameter that a whole accumulator stands for (not a ZeRO-3 partition's): one view.
        """
        if not self.nodes:
            return
        first = self.params[self.indices[0]]
        if not first.requires_grad or first.shape != ds_compat.full_shape(first):  # toggled off; a ZeRO-3 partition
            return
        if gradient_accumulator(first) is self.nodes[0]:
            return
        self.nodes = [ds_compat.gradient_accumulator(self.params[index]) for index in self.indices]

    def unreached(self, executed: list[bool]) -> list[int]:
        """The parameters that require a gradient and that the backward does not reach (by index)."""
        return [i for i, hit in zip(self.indices, executed, strict=True) if not hit and self.params[i].requires_grad]


class Router:
    """Routes each backward through the engines it reaches; holds the backward running now, for the gradient hooks.

    Not thread-local: autograd runs a CUDA backward, and so the parameter hooks, on its own device thread.

    By default a backward learns what it reaches from one query of the autograd engine when it starts (each
    engine's gradient accumulators, :data:`~lightning_multids._compat.torch.will_execute`): no Python runs per
    parameter and no collective. Per-parameter tensor hooks (:meth:`_gradient_hook`) are added where the query
    cannot see: for a backward after a reentrant activation checkpoint's forward (its parameters appear only in its
    own nested backward), and for every backward with ``find_unused=True`` (``find_unused_parameters``), where the
    ranks compare what each reached, in order, after the backward (:func:`agree`).
    """

    def __init__(self, find_unused: bool = False) -> None:
        self.current: Route | None = None
        self.find_unused = find_unused
        self.sizes: dict[str, int] = {}
        """Each watched engine's number of parameters."""
        self._watched: OrderedDict[int, _Watched] = OrderedDict()  # a dict a handle can refer to weakly
        """By the id of the handle :meth:`watch` returned: removing the handle lets the accumulators go."""
        self._hooks: dict[str, list[Callable[[torch.Tensor], torch.Tensor | None]]] = {}
        self._checkpoints: ForwardCounter | None = None
        """Counts reentrant checkpoints' forwards: once one ran in this fit, every backward is hooked too."""
        self._several_ranks: bool | None = None
        """Whether the fit runs on several ranks (read at its first backward)."""

    def watch(self, name: str, engine: DeepSpeedEngine) -> list[RemovableHandle]:
        """Hold ``engine``'s gradient accumulators (once, at setup); returns the handles that teardown removes.

        With ``find_unused``, also hook its trainable parameters (:meth:`_gradient_hook`) for every backward.
        """
        params = list(engine.module.parameters())
        self.sizes[name] = len(params)
        trained = [index for index, param in enumerate(params) if param.requires_grad]
        late = [index for index, param in enumerate(params) if not param.requires_grad]
        nodes = [ds_compat.gradient_accumulator(params[index]) for index in trained]
        held = RemovableHandle(self._watched)
        self._watched[held.id] = _Watched(name, engine, params, nodes, trained, late)
        self._hooks[name] = [self._gradient_hook(name, engine, index) for index in range(len(params))]
        if self._checkpoints is None:
            self._checkpoints = ForwardCounter(REENTRANT)
        handles = [held, _Closing(self._stop_counting)]
        if self.find_unused:
            handles += [p.register_hook(self._hooks[name][i]) for i, p in enumerate(params) if p.requires_grad]
        else:
            hook = self._output_hook(name)  # on each part of an engine over several: its own forward never runs
            handles += [part.register_forward_hook(hook) for part in called_modules(engine.module)]
        return handles

    def _watching(self, name: str) -> _Watched:
        return next(watched for watched in self._watched.values() if watched.name == name)

    def _accumulates(self, name: str) -> bool:
        """Inside a backward: whether it gives a parameter of engine ``name`` a gradient (not under autograd.grad)."""
        try:
            return any(map(will_execute, self._watching(name).nodes))
        except RuntimeError:  # "... we are currently running autograd.grad()": nothing is accumulated
            return False

    def _output_hook(self, name: str) -> Callable[..., None]:
        """A forward hook of engine ``name``'s module: a backward outside a route through its output is refused.

        Without per-parameter hooks, the engine's outputs carry the check (one tensor hook per call with a
        gradient, as ``engine.forward`` puts its own on every output): a plain ``loss.backward()`` through them is
        refused before it reaches the parameters. A weight read outside ``forward`` is not seen there; the engine's
        ``opt.step()`` then refuses to step without a routed backward.
        """

        def check(grad: torch.Tensor) -> None:
            route = self.current
            if route is None:
                if self._accumulates(name):
                    _refuse_unrouted(name)
            elif name not in route.entered and name not in route.hooked and self._accumulates(name):
                self._found_late(route, name)

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                for tensor in output_tensors(output):
                    if tensor.grad_fn is not None:  # a leaf (a parameter returned) keeps its hooks: none on it
                        tensor.register_hook(check)

        return hook

    def _found_late(self, route: Route, name: str) -> None:
        """An engine the start of the backward did not see is reached after all: enter it and hook its parameters.

        Its output's gradient arrives in a backward that the query could not answer for: the nested backward of a
        reentrant checkpoint that is not torch's or DeepSpeed's, or a backward of another tensor than the loss
        (a ``LightningModule.backward`` override). Its parameters' hooks then see their gradients arrive.
        """
        if route.engines.get(name) is None:
            return
        route.enter(name)
        route.handles += self._hook(route, name)

    def _stop_counting(self) -> None:
        """After a watched engine's handle was removed (teardown): once none is left, stop counting and hooking."""
        if self._watched:
            return
        self._hooks.clear()
        if self._checkpoints is not None:
            self._checkpoints.close()
            self._checkpoints = None

    def _start(self, route: Route) -> list[RemovableHandle]:
        """At the start of ``route``'s backward: enter the engines it reaches; hook where the query cannot see.

        Returns the hooks added for this backward only (after a reentrant checkpoint's forward).
        """
        watched = {w.name: w for w in self._watched.values() if route.engines.get(w.name) is w.engine}
        checkpointed = self._checkpoints is not None and self._checkpoints.count > 0
        hooked = not self.find_unused and (checkpointed or bool(route.factors))
        judged = not (self.find_unused or hooked)  # else hooks see the reach, judged after the backward
        for name in sorted(watched):
            entry = watched[name]
            entry.hold_late()
            entry.hold_again_if_replaced()
            try:  # hooks see the reach per parameter where there are some
                executed = list(map(will_execute, entry.nodes)) if judged else [any(map(will_execute, entry.nodes))]
            except RuntimeError:  # under torch.autograd.grad: nothing is accumulated, nothing is reached
                return []
            if not any(executed):
                continue
            if name not in route.entered:
                route.enter(name)
            if judged and not all(executed):
                route_missing(route, entry, executed)
        if judged:
            route.refuse_unreached()
        if not hooked:
            return []
        return [hook for name in sorted(watched) for hook in self._hook(route, name)]

    def _hook(self, route: Route, name: str) -> list[RemovableHandle]:
        """Hook engine ``name``'s trainable parameters for ``route``'s backward only (see :meth:`_gradient_hook`)."""
        route.hooked.add(name)
        hooks = self._hooks[name]
        params = self._watching(name).params
        return [param.register_hook(hooks[index]) for index, param in enumerate(params) if param.requires_grad]

    def _gradient_hook(
        self, name: str, engine: DeepSpeedEngine, index: int
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """The tensor hook of ``engine``'s parameter number ``index`` (:meth:`watch`).

        A closure, and after the engine's first gradient of a phase only a comparison and a record of the
        arrival: it runs once per parameter per backward.
        """

        def on_gradient(grad: torch.Tensor) -> torch.Tensor | None:
            route = self.current
            if route is None:
                _refuse_unrouted(name)
                return None
            phases = route.entered.get(name)
            if phases is None:
                if route.engines.get(name) is not engine:
                    return None
                phases = route.enter(name)
            task = current_graph_task_id()
            if task != phases.task or not phases.pending:  # the engine's first gradient in this (nested) backward
                _start_phase(route, engine, phases, task)
            arrived = phases.arrived
            if index not in arrived:
                arrived[index] = len(arrived) + 1
            if route.factors:
                factor = route.factors.get(name, 1.0)
                return grad * factor if factor != 1.0 else None
            return None

        return on_gradient

    @contextmanager
    def routed(
        self,
        loss: torch.Tensor,
        engines: Mapping[str, DeepSpeedEngine],
        reach: Reach = UNWALKED,
        factors: Mapping[str, float] | None = None,
    ) -> Iterator[Route]:
        """Run the body (one ``loss.backward()``) inside the prologue/epilogue of every engine it reaches.

        Args:
            loss: the tensor the body backpropagates.
            engines: every trainable engine, by name; each must be watched (:meth:`watch`).
            reach: what a walk of the graph found; those engines are entered before the body, in name order.
                By default nothing is walked, and each engine is entered when its first gradient arrives.
            factors: a factor by which to multiply each engine's gradients as they arrive (1 if missing).

        On an exception (a CUDA out-of-memory error that the caller may catch and go on from) no epilogue
        runs, since it would reduce on this rank alone: every entered engine is reset and drops its gradients
        of this step (:func:`~lightning_multids._compat.deepspeed.abandon_backward`), and leaves the backward.
        """
        if self._several_ranks is None:
            self._several_ranks = _several_ranks()
        route = Route(engines, factors or {}, self.sizes, agreeing=self.find_unused, several_ranks=self._several_ranks)

        def start(grad: torch.Tensor) -> torch.Tensor:
            route.root_task, route.ran = current_graph_task_id(), True
            route.handles += self._start(route)
            return grad

        handle = loss.register_hook(start) if loss.requires_grad else None
        previous, self.current = self.current, route
        try:
            for name in sorted(reach.names):
                route.enter(name)
            yield route
            route.finish()
        except BaseException:
            route.abandon()
            raise
        finally:
            self.current = previous
            route.leave()
            for hook in [*route.handles, *([handle] if handle is not None else [])]:
                hook.remove()


def route_missing(route: Route, entry: _Watched, executed: list[bool]) -> None:
    """What a judged backward (one query) leaves without a gradient in ``entry``'s engine, by ``executed``.

    Its trained parameters that require a gradient and are not reached: ZeRO-1 fills them, ZeRO-2/3 refuse them on
    several ranks (:meth:`Route.finish`); ZeRO-0's reduction fills them itself. And what :attr:`Route.missing` keeps.
    """
    got = [True] * len(entry.params)
    for index, hit in zip(entry.indices, executed, strict=True):
        got[index] = hit
    route.note_missing(entry.name, got)
    if entry.engine.zero_optimization_stage() > 0:
        unreached = entry.unreached(executed)
        if unreached:
            route.unreached[entry.name] = unreached


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a module's output: a tensor, or inside tuples, lists and dicts (a ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, tuple | list):
        for item in output:
            yield from output_tensors(item)
    elif isinstance(output, Mapping):
        for item in output.values():
            yield from output_tensors(item)


class _Closing(RemovableHandle):
    """A handle whose removal calls ``close``."""

    def __init__(self, close: Callable[[], None]) -> None:
        super().__init__(OrderedDict())
        self._close = close

    def remove(self) -> None:
        self._close()


def _refuse_unrouted(name: str) -> None:
    """Raise if a backward outside ``manual_backward`` is about to accumulate a gradient of engine ``name``.

    Called from a parameter's tensor hook (``find_unused_parameters``), or by default from the tensor hook on each of
    the engine's outputs, where the backward gives one of its parameters a gradient. Such a backward
    (``loss.backward()``, ``torch.autograd.backward``) runs no prologue or epilogue, and ZeRO's gradient hooks would
    reduce into state the next routed backward then trips over; it is refused here, before the gradient reaches
    ``param.grad`` or ZeRO. ``torch.autograd.grad`` accumulates
    nothing and passes (:func:`~lightning_multids._compat.torch.accumulates_into`).
    """
    if accumulates_into():
        raise RuntimeError(
            f"A backward outside `self.manual_backward` reached the parameters of engine {name!r} (a plain "
            "`loss.backward()` or `torch.autograd.backward(...)`). Under MultiDeepSpeedStrategy a backward that gives "
            "an engine gradients must run through `self.manual_backward(loss)`, which runs DeepSpeed's reduction for "
            "every engine it reaches: replace the call with `self.manual_backward(loss)`. For gradients with respect "
            "to inputs only (a saliency map, a penalty), use `torch.autograd.grad(output, inputs)`."
        )


def _start_phase(route: Route, engine: DeepSpeedEngine, phases: _Phases, task: int) -> None:
    """An engine's first gradient in graph task ``task``: close its pending phase of another task, note this one.

    A plain call's gradients, then a reentrant checkpoint's, form two phases; a nested task (not the root's)
    closes its phase when it ends.
    """
    if phases.pending and task != phases.task:
        _end_phase(engine, phases)
    phases.pending, phases.task = True, task
    if task not in (route.root_task, -1) and task not in phases.ended:
        phases.ended.add(task)
        queue_callback(lambda: _end_phase(engine, phases))


def _end_phase(engine: DeepSpeedEngine, phases: _Phases) -> None:
    """At the end of a nested graph task: reduce-scatter what arrived (ZeRO-2/3) before more arrives.

    Only the reduction runs here, not the whole epilogue: ZeRO-3's also releases every submodule
    still on the backward stack, which the outer backward needs. At stage 0/1 a backward only
    accumulates locally, so a gradient arriving twice needs nothing.
    """
    if not phases.pending or ds_compat.in_no_sync(engine):  # no_sync: the gradients accumulate locally
        return
    phases.pending = False
    if engine.zero_optimization_partition_gradients():
        phases.reduced = True
        ds_compat.reduce_phase(engine)


def agree(route: Route) -> set[str]:
    """Agree across ranks on what each rank's backward reached; enter the engines reached elsewhere only.

    One all-reduce (MAX) after every backward when there are several ranks, of 4 integers per trainable engine and
    2 per parameter: whether this rank entered the engine, whether it reduced some of its gradients before the
    epilogue, and for each parameter the order in which its gradient first arrived (0: none); each with its
    negative, which gives the minimum over ranks too. The exact sets and orders are compared: ZeRO-2 buckets
    gradients in arrival order, so two ranks that reach the same parameters in another order must be evened out
    too. Returns the engines whose reach differs between ranks (entered on every rank now).

    Raises:
        RuntimeError: on every rank, for a ZeRO-2/3 engine whose reach differs and that already reduced
            gradients during the backward, which cannot be evened out.
    """
    if not _several_ranks() or not route.engines:
        return set()
    names = sorted(route.engines)
    local: list[int] = []
    for name in names:
        phases = route.entered.get(name)
        reduced = int(phases is not None and (phases.reduced or ds_compat.reduced_during_backward(route.engines[name])))
        order = [phases.arrived.get(index, 0) if phases else 0 for index in range(route.sizes.get(name, 0))]
        local += [int(phases is not None), reduced, *order]
    device = next(iter(route.engines.values())).device
    state = torch.tensor([*local, *(-value for value in local)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(state, op=torch.distributed.ReduceOp.MAX)
    values = state.tolist()
    highest, lowest = values[: len(local)], [-value for value in values[len(local) :]]
    uneven, reduced_uneven, offset = set(), set(), 0
    for name in names:
        width = 2 + route.sizes.get(name, 0)
        high, low = highest[offset : offset + width], lowest[offset : offset + width]
        offset += width
        if high[0] == 1:
            missing = [index for index, order in enumerate(high[2:]) if order == 0]  # on no rank
            if missing:
                route.missing[name] = missing
        if high[0] == 1 and high != low:
            uneven.add(name)
            if high[1]:
                reduced_uneven.add(name)
    for name in sorted(reduced_uneven):
        _refuse_reduced_uneven(name)
    for name in sorted(uneven - set(route.entered)):
        route.enter(name)
    return uneven


def refuse_uneven_zero3(reach: Reach, zero3: list[str], device: torch.device) -> None:
    """Before a backward on several ranks: refuse, on every rank, a loss that reaches a ZeRO-3 engine on some only.

    A ZeRO-3 engine's backward gathers its parameters submodule by submodule, collectives that a rank whose loss
    does not reach the engine never joins: the others would wait in them until the collective timeout (a gloo
    error, or an NCCL hang). One all-reduce (MAX) of 1 + 2 integers per trained ZeRO-3 engine (``zero3``), of what
    each rank's graph reaches (``reach``, from a walk). Where a rank's graph holds a reentrant activation
    checkpoint, what it reaches is not known before the backward, and nothing is refused.

    Raises:
        RuntimeError: on every rank, naming the first such engine and the fix.
    """
    local = [int(name in reach.names) for name in zero3]
    state = torch.tensor([int(reach.hidden), *local, *(-value for value in local)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(state, op=torch.distributed.ReduceOp.MAX)
    values = state.tolist()
    if values[0]:
        return
    for index, name in enumerate(zero3):
        if values[1 + index] != -values[1 + len(zero3) + index]:
            raise RuntimeError(
                f"The loss reaches the ZeRO-3 engine {name!r} on some ranks and not on others. ZeRO-3 gathers "
                f"{name!r}'s parameters during its backward, collectives every rank must join, so the ranks would "
                "wait for each other until the collective timeout. Give the loss the same terms on every rank (a "
                f"term that does not apply on a rank can be kept with weight zero: `loss + 0.0 * term`), or use "
                f"ZeRO-0/1/2 for {name!r}, where the strategy evens the gradients out after the backward."
            )


def _several_ranks() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _refuse_unreached(name: str, engine: DeepSpeedEngine, unreached: list[int]) -> None:
    params = dict(enumerate(engine.module.named_parameters()))
    names = ", ".join(params[index][0] for index in unreached[:3]) + (", ..." if len(unreached) > 3 else "")
    raise RuntimeError(
        f"The loss reached engine {name!r} but not all of its trained parameters ({names}). Its "
        f"ZeRO-{engine.zero_optimization_stage()} reduction buckets gradients in the order they arrive, so ranks "
        "that reach other parameters would mix them up; as under DDP, parameters left without a gradient need "
        "`MultiDeepSpeedStrategy(find_unused_parameters=True)`, where the ranks compare what each backward reached "
        f"and reduce alike (one all-reduce per backward). Or give the unused parameters `requires_grad=False`, or "
        f"give {name!r} ZeRO-0/1, which fill them with zero gradients by themselves."
    )


def _refuse_reduced_uneven(name: str) -> None:
    raise RuntimeError(
        f"The loss reached engine {name!r} (or some of its parameters) on some ranks and not on others, and ZeRO-2/3 "
        f"had already reduced part of {name!r}'s gradients during the backward (its bucket filled, or a reentrant "
        "activation checkpoint closed a phase), which the other ranks did not match. Run such backwards inside "
        f"`self.trainer.strategy.no_sync({name!r})` (gradients stay local until the block ends), or raise "
        f"`zero_optimization.reduce_bucket_size` of {name!r} above its parameter count."
    )
