"""Engine discovery: optimizers matched to submodules at setup, and what a loss reaches at backward.

What a loss reaches is checked on hundreds of random graphs: the engines found are those autograd gives a gradient.

Each graph is built from four trainable engines, a frozen engine, a plain submodule and two inputs, with
the operations users write: an engine called twice, engines chained, a submodule of one engine called
inside another's path, ``detach``, ``no_grad`` segments, an engine toggled off (``toggle_optimizer``),
reentrant and non-reentrant activation checkpointing. The reference is autograd itself:
``torch.autograd.grad(loss, params, allow_unused=True)``, or, for graphs with a reentrant checkpoint
(which ``autograd.grad`` refuses), the parameters whose ``.grad`` a plain backward fills.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_multids._discovery import (
    UNWALKED,
    Reach,
    check_engine_names,
    match_optimizers,
    match_parts,
    parameter_owners,
    reached_engines,
)
from lightning_multids._routing import Router
from tests import patterns
from tests.fakes import FakeEngine, routed_engine_set

TRAINABLE = ("a", "b", "c", "d")
GRAPHS = 400


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


class Graph:
    """Random modules and a random loss over them; ``build`` returns the loss, or None if it needs no gradient."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.modules: dict[str, nn.Module] = {name: mlp() for name in (*TRAINABLE, "frozen", "plain")}
        self.modules["frozen"].requires_grad_(False)
        self.reentrant = False
        self.calls: list[tuple[str, str]] = []
        self.engines = {name: FakeEngine(name, self.modules[name], self.calls) for name in TRAINABLE}
        self.router = Router()  # watching from before the forward, as from setup: it sees reentrant checkpoints
        for name, engine in self.engines.items():
            self.router.watch(name, engine)  # type: ignore[arg-type]

    def owners(self) -> dict[int, str]:
        return {id(p): name for name in TRAINABLE for p in self.modules[name].parameters()}

    def call(self, x: torch.Tensor) -> torch.Tensor:
        """One engine, two chained, or a submodule of one engine inside another's path."""
        names = list(self.modules)
        first, second = self.rng.choice(names), self.rng.choice(names)
        kind = self.rng.choice(("one", "chain", "shared"))
        if kind == "one":
            return self.modules[first](x)
        if kind == "chain":
            return self.modules[second](self.modules[first](x))
        return self.modules[second][2](torch.tanh(self.modules[first][0](x)))  # type: ignore[index]

    def checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        reentrant = self.rng.random() < 0.5
        self.reentrant |= reentrant
        seed = self.rng.random()

        def segment(h: torch.Tensor) -> torch.Tensor:
            local = random.Random(seed)  # the recomputation must take the same path
            state, self.rng = self.rng, local
            try:
                return self.call(h)
            finally:
                self.rng = state

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "None of the inputs have requires_grad=True": a valid case here
            return checkpoint(segment, x, use_reentrant=reentrant)

    def build(self) -> torch.Tensor | None:
        pool = [torch.randn(3, 4), torch.randn(3, 4).requires_grad_(self.rng.random() < 0.5)]
        for name in self.rng.sample(TRAINABLE, self.rng.choice((0, 0, 1, 2))):
            # toggle_optimizer: off before the forward, on again after the backward
            self.modules[name].requires_grad_(False)
        for _ in range(self.rng.randint(2, 8)):
            x = self.rng.choice(pool)
            op = self.rng.choice(("call", "call", "detach", "no_grad", "checkpoint", "combine"))
            if op == "call":
                pool.append(self.call(x))
            elif op == "detach":
                pool.append(x.detach())
            elif op == "no_grad":
                with torch.no_grad():
                    pool.append(self.call(x))
            elif op == "checkpoint":
                pool.append(self.checkpointed(x))
            else:
                pool.append(x * self.rng.choice(pool) + self.rng.choice(pool))
        loss = sum(t.sum() for t in self.rng.sample(pool, self.rng.randint(1, len(pool))))
        assert isinstance(loss, torch.Tensor)
        return loss if loss.requires_grad else None

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name in TRAINABLE for p in self.modules[name].parameters() if p.requires_grad]


def autograd_reach(graph: Graph, loss: torch.Tensor) -> set[str]:
    """The engines autograd gives a gradient, without running any hook of the strategy's."""
    named = graph.params()
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True, retain_graph=True)
    return {name for (name, _), grad in zip(named, grads, strict=True) if grad is not None}


def routed_backward(graph: Graph, loss: torch.Tensor, reach: Reach) -> tuple[set[str], list[tuple[str, str]]]:
    """Backpropagate ``loss`` through the strategy's routing with watched fake engines."""
    engines = graph.engines
    with graph.router.routed(loss, engines, reach) as route:  # type: ignore[arg-type]
        loss.backward()
    assert not any(engine._running_engine_backward for engine in engines.values())
    return set(route.entered), graph.calls


def check(seed: int, walk: Callable[[torch.Tensor, dict[int, str]], Reach] = reached_engines) -> str | None:
    """Return what went wrong on graph ``seed``, or None."""
    graph = Graph(seed)
    loss = graph.build()
    if loss is None:
        return None
    return compare(graph, loss, walk)


def compare(graph: Graph, loss: torch.Tensor, walk: Callable[[torch.Tensor, dict[int, str]], Reach]) -> str | None:
    reach = walk(loss, graph.owners())
    if graph.reentrant:  # autograd.grad refuses reentrant checkpoints: read .grad after a plain backward
        entered, calls = routed_backward(graph, loss, reach)
        expected = {name for name, p in graph.params() if p.grad is not None}
        if not reach.names <= expected or (expected - reach.names and not reach.hidden):
            return f"walk found {sorted(reach.names)} (hidden={reach.hidden}), autograd reached {sorted(expected)}"
    else:
        expected = autograd_reach(graph, loss)
        if set(reach.names) != expected:
            return f"walk found {sorted(reach.names)}, autograd reached {sorted(expected)}"
        entered, calls = routed_backward(graph, loss, reach)
    if entered != expected:
        return f"entered {sorted(entered)}, autograd reached {sorted(expected)}"
    prologues = [name for kind, name in calls if kind == "prologue"]
    epilogues = [name for kind, name in calls if kind == "epilogue"]
    if sorted(prologues) != sorted(expected) or epilogues != sorted(expected):
        return f"prologues {prologues}, epilogues {epilogues}: want each of {sorted(expected)} once, in name order"
    return None


def test_engines_found_are_the_engines_autograd_reaches() -> None:
    failures = {seed: error for seed in range(GRAPHS) if (error := check(seed)) is not None}
    assert not failures, f"{len(failures)} of {GRAPHS} graphs, e.g. {list(failures.items())[:3]}"


def test_engines_entered_as_gradients_arrive_are_the_engines_autograd_reaches() -> None:
    """Without a walk (every engine at one loss scale), each reached engine is entered by its first gradient."""
    failures = {}
    for seed in range(GRAPHS):
        graph = Graph(seed)
        loss = graph.build()
        if loss is None:
            continue
        expected = None if graph.reentrant else autograd_reach(graph, loss)
        entered, calls = routed_backward(graph, loss, UNWALKED)
        if expected is None:  # autograd.grad refuses reentrant checkpoints: read .grad after the backward
            expected = {name for name, p in graph.params() if p.grad is not None}
        prologues = [name for kind, name in calls if kind == "prologue"]
        epilogues = [name for kind, name in calls if kind == "epilogue"]
        if entered != expected or sorted(prologues) != sorted(expected) or epilogues != sorted(expected):
            failures[seed] = f"prologues {prologues}, epilogues {epilogues}, autograd reached {sorted(expected)}"
    assert not failures, f"{len(failures)} of {GRAPHS} graphs, e.g. {list(failures.items())[:3]}"


def test_the_generator_covers_every_case() -> None:
    """The random graphs do hit the cases named above, hidden engines behind reentrant checkpoints included."""
    hidden_only = 0
    for seed in range(GRAPHS):
        graph = Graph(seed)
        loss = graph.build()
        if loss is not None and graph.reentrant:
            reach = reached_engines(loss, graph.owners())
            entered, _ = routed_backward(graph, loss, reach)
            hidden_only += bool(entered - reach.names)
    assert hidden_only >= 10


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_engine_inside_a_checkpoint_is_entered_once(reentrant: bool) -> None:
    """``D(G(z))`` with both engines wholly inside one checkpoint: with reentrant, the walk cannot see them."""
    graph = Graph(0)
    z = torch.randn(2, 4, requires_grad=True)
    g, d = graph.modules["a"], graph.modules["b"]
    loss = checkpoint(lambda h: d(g(h)), z, use_reentrant=reentrant).sum()
    reach = reached_engines(loss, graph.owners())
    assert reach.hidden == reentrant
    assert reach.names == (frozenset() if reentrant else {"a", "b"})
    entered, calls = routed_backward(graph, loss, reach)
    assert entered == {"a", "b"}
    assert [c for c in calls if c[0] == "epilogue"] == [("epilogue", "a"), ("epilogue", "b")]


@pytest.mark.parametrize("find_unused", [False, True])
def test_an_exception_in_backward_leaves_every_engine_out_of_it(find_unused: bool) -> None:
    graph = Graph(0)
    engines = {name: FakeEngine(name, graph.modules[name], []) for name in TRAINABLE}
    router = Router(find_unused)
    for name, engine in engines.items():
        router.watch(name, engine)  # type: ignore[arg-type]
    loss = graph.modules["b"](graph.modules["a"](torch.randn(2, 4))).sum()
    reach = reached_engines(loss, graph.owners())
    with pytest.raises(RuntimeError, match="out of memory"), router.routed(loss, engines, reach):  # type: ignore[arg-type]
        raise RuntimeError("out of memory")
    assert not any(e._running_engine_backward or e._running_engine_backward_count for e in engines.values())
    # no epilogue over a failed backward: the gradients it may have left are dropped instead
    assert engines["a"].calls == [("prologue", "a"), ("cleared", "a")]
    assert router.current is None
    with pytest.raises(RuntimeError, match="backward outside `self.manual_backward`"):
        loss.backward()  # outside a route (parameters' hooks, or by default the outputs') refused, entering nothing
    assert engines["a"].calls == [("prologue", "a"), ("cleared", "a")] and not engines["c"].calls


def test_a_hidden_graph_that_reaches_no_engine_is_refused_after_its_backward() -> None:
    """Behind a reentrant checkpoint only the backward shows what is reached; reaching nothing is an error."""
    graph = Graph(0)
    calls: list[tuple[str, str]] = []
    engines = {name: FakeEngine(name, graph.modules[name], calls) for name in TRAINABLE}
    engine_set = routed_engine_set(engines)
    x = torch.randn(2, 4, requires_grad=True)
    loss = checkpoint(graph.modules["plain"], x, use_reentrant=True).sum()
    with pytest.raises(ValueError, match=r"reaches no trainable engine \('a', 'b', 'c', 'd'\)"):  # noqa: SIM117
        with engine_set.backward(loss) as scaled:
            scaled.backward()
    assert x.grad is not None and not calls and engine_set.backward_calls == 0

    loss = checkpoint(graph.modules["b"], x, use_reentrant=True).sum()
    with engine_set.backward(loss) as scaled:
        scaled.backward()
    assert calls == [("prologue", "b"), ("epilogue", "b")] and engine_set.backward_calls == 1
    assert [record.has_gradients for record in engine_set.trainable] == [False, True, False, False]


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = patterns.make_modules()
        self.scale = nn.Parameter(torch.ones(1))


def sgd(*params: object) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=0.1)  # type: ignore[arg-type]


def test_each_optimizer_is_matched_to_its_submodule_in_order() -> None:
    gan = GAN()
    optimizers = [sgd(*gan.discriminator.parameters()), sgd(*gan.generator.parameters())]
    assert list(match_optimizers(gan, optimizers).items()) == [("discriminator", 0), ("generator", 1)]


def test_optimizer_with_several_param_groups_of_one_submodule() -> None:
    gan = GAN()
    first, *rest = gan.generator.parameters()
    optimizer = torch.optim.SGD([{"params": [first], "lr": 0.1}, {"params": rest, "lr": 0.01}])
    assert match_optimizers(gan, [optimizer]) == {"generator": 0}


def test_optimizer_spanning_two_submodules_is_one_engine_named_by_the_first_in_the_modules_order() -> None:
    gan = GAN()
    optimizer = sgd(*gan.discriminator.parameters(), *gan.generator.parameters())
    assert match_parts(gan, [optimizer]) == [("generator", "discriminator")]
    assert match_optimizers(gan, [optimizer]) == {"generator": 0}


def test_two_optimizers_spanning_one_submodule_are_refused() -> None:
    gan = GAN()
    first, *rest = gan.discriminator.parameters()
    optimizers = [sgd(*gan.generator.parameters(), first), sgd(*rest)]
    with pytest.raises(
        ValueError, match=r"Optimizers 0 and 1 both train 'discriminator'.*one DeepSpeed engine per optimizer"
    ):
        match_optimizers(gan, optimizers)


def test_parameter_in_two_optimizers_is_refused() -> None:
    gan = GAN()
    shared = next(gan.generator.parameters())
    optimizers = [sgd(*gan.generator.parameters()), sgd(shared)]
    with pytest.raises(
        ValueError, match=r"parameter of 'generator' is in optimizer 0 and optimizer 1.*remove it from one"
    ):
        match_optimizers(gan, optimizers)


def test_parameter_of_the_lightning_module_itself_is_refused() -> None:
    gan = GAN()
    with pytest.raises(ValueError, match=r"belongs to the LightningModule itself.*move the parameter into a submodule"):
        match_optimizers(gan, [sgd(gan.scale)])


def test_two_optimizers_for_one_submodule_are_refused() -> None:
    gan = GAN()
    first, *rest = gan.generator.parameters()
    with pytest.raises(ValueError, match=r"Optimizers 0 and 1 both train 'generator'.*several parameter groups"):
        match_optimizers(gan, [sgd(first), sgd(*rest)])


def test_engines_key_that_is_not_a_submodule_lists_the_submodules() -> None:
    with pytest.raises(
        ValueError, match=r"entry for 'critic'.*no submodule of that name.*'generator', 'discriminator'"
    ):
        check_engine_names(GAN(), ["generator", "critic"])


def test_parameter_owners_skips_the_modules_own_parameters() -> None:
    gan = GAN()
    owners = parameter_owners(gan)
    assert id(gan.scale) not in owners
    assert {owners[id(p)] for p in gan.generator.parameters()} == {"generator"}


def owners_of(gan: GAN) -> dict[int, str]:
    return {id(p): name for name in ("generator", "discriminator") for p in getattr(gan, name).parameters()}


def test_reached_engines_follows_the_graph_and_respects_detach() -> None:
    gan = GAN()
    real, z = patterns.split(torch.randn(4, 10))
    fake = gan.generator(z)
    d_loss = gan.discriminator(real).mean() + gan.discriminator(fake.detach()).mean()
    g_loss = gan.discriminator(fake).mean()
    assert reached_engines(d_loss, owners_of(gan)).names == {"discriminator"}
    assert reached_engines(g_loss, owners_of(gan)).names == {"discriminator", "generator"}
    assert reached_engines(gan.generator(z).detach().sum(), owners_of(gan)).names == set()


def test_reached_engines_skips_an_engine_whose_gradients_are_off() -> None:
    gan = GAN()
    gan.discriminator.requires_grad_(False)
    loss = gan.discriminator(gan.generator(torch.randn(2, 4))).sum()
    assert reached_engines(loss, owners_of(gan)).names == {"generator"}


class OwnCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint of one's own (as fairscale or Megatron write it): recomputes in a nested backward."""

    @staticmethod
    def forward(ctx: Any, fn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


def test_an_engine_inside_a_reentrant_checkpoint_of_ones_own_is_entered_once() -> None:
    """The start of the backward cannot see it; its output's hook, in the nested backward, enters and hooks it."""
    graph = Graph(0)
    a, b = graph.modules["a"], graph.modules["b"]
    loss = OwnCheckpoint.apply(b, a(torch.randn(2, 4))).sum()
    entered, calls = routed_backward(graph, loss, UNWALKED)
    assert entered == {"a", "b"}
    assert sorted(calls) == [("epilogue", "a"), ("epilogue", "b"), ("prologue", "a"), ("prologue", "b")]


@pytest.mark.parametrize("change", ["double", "data_round_trip"])
def test_an_engine_whose_parameters_changed_dtype_is_still_entered(change: str) -> None:
    """torch makes a parameter a new gradient accumulator when its dtype or device changes (DeepSpeed's offloading
    moves ``p.data`` to the CPU and back): the router holds the new one."""
    graph = Graph(0)
    module = graph.modules["a"]
    if change == "double":
        module.double()
    else:
        for param in module.parameters():
            kept = param.data
            param.data = kept.double()
            param.data = kept
    dtype = next(module.parameters()).dtype
    entered, calls = routed_backward(graph, module(torch.randn(2, 4, dtype=dtype)).sum(), UNWALKED)
    assert entered == {"a"} and calls == [("prologue", "a"), ("epilogue", "a")]


def test_the_output_check_leaves_no_hook_on_a_parameter_returned_by_a_forward() -> None:
    class Prior(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mu = nn.Parameter(torch.zeros(3))

        def forward(self) -> torch.Tensor:
            return self.mu

    prior = Prior()
    router = Router()
    handles = router.watch("prior", FakeEngine("prior", prior, []))  # type: ignore[arg-type]
    for _ in range(3):
        prior()
    assert not prior.mu._backward_hooks
    for handle in handles:
        handle.remove()
