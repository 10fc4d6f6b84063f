"""Discovery: which submodule each optimizer trains (at setup), and which engines a loss reaches (per backward).

Engines are found from the optimizers of ``configure_optimizers``: one engine per optimizer, over the direct
children of the LightningModule that hold its parameters (:func:`match_parts`). A loss reaches the engines whose
parameters its autograd graph holds. The router finds them as their gradients arrive
(:mod:`lightning_multids._routing`); only where the loss's scale depends on them (fp16 engines at different
loss scales) are they read off the graph before the backward runs (:func:`reached_engines`), at a cost that
grows with the graph.

The walk holds every node it visits (``seen`` is a set of the node objects themselves). Python's
view of an autograd node is a wrapper made when ``grad_fn``/``next_functions`` is read and freed
once nothing holds it; torch hands out the same wrapper for a node only while that wrapper is
alive. Deduplicating by ``id()`` of wrappers that were let go can take a node met later for one
already seen (a freed wrapper's address reused) and skip it: the engines behind it go missing.
Holding them makes every identity check a check on a live object.

A reentrant activation checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``,
DeepSpeed's ``checkpointing.checkpoint``) runs its forward without recording a graph; the parameters
inside it appear only when its backward recomputes the forward. The walk cannot see them, so it
says that the graph holds such a node (``Reach.hidden``); :mod:`lightning_multids._routing` then
also enters, during the backward, any engine whose gradients arrive without having been found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.optim import Optimizer

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.torch import forward_class

REENTRANT = (torch.utils.checkpoint.CheckpointFunction, *ds_compat.reentrant_checkpoint_functions())


@dataclass(frozen=True)
class Reach:
    """What the graph of one loss shows before its backward.

    Attributes:
        names: the trainable engines whose parameters the graph reaches.
        hidden: whether more engines than ``names`` may be reached: the graph holds a reentrant checkpoint,
            or it was not walked (:data:`UNWALKED`).
    """

    names: frozenset[str]
    hidden: bool


UNWALKED = Reach(frozenset(), hidden=True)
"""No walk: any engine may be reached, and each is entered as its first gradient arrives."""


def reached_engines(loss: torch.Tensor, owners: Mapping[int, str]) -> Reach:
    """Walk the autograd graph of ``loss`` and return the trainable engines it reaches.

    Args:
        loss: the tensor ``backward`` will be called on.
        owners: ``id(parameter) -> engine name`` for every trainable engine parameter. Parameters live as
            long as their engine, so their ``id`` is stable (the short-lived objects here are the nodes).

    The walk visits each node once and stops early when every engine has been found.
    """
    root = loss.grad_fn
    if root is None:
        return Reach(frozenset(), hidden=False)
    wanted = len(set(owners.values()))
    found: set[str] = set()
    hidden = False
    seen: set[Any] = {root}  # the node objects themselves: alive for the whole walk
    stack = [root]
    while stack and len(found) < wanted:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if variable is not None:
            name = owners.get(id(variable))
            if name is not None:
                found.add(name)
            continue
        if forward_class(node) in REENTRANT:
            hidden = True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return Reach(frozenset(found), hidden)


def parameter_owners(module: nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to the name of the direct child of ``module`` that holds it.

    Parameters held by ``module`` itself (not by a child) are left out.
    """
    owners: dict[int, str] = {}
    for name, child in module.named_children():
        for param in child.parameters():
            owners.setdefault(id(param), name)
    return owners


def match_optimizers(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, int]:
    """Return ``engine name -> index of its optimizer``; an engine is named by its first part (:func:`match_parts`)."""
    return {parts[0]: index for index, parts in enumerate(match_parts(module, optimizers))}


def match_parts(module: nn.Module, optimizers: Sequence[Optimizer]) -> list[tuple[str, ...]]:
    """For each optimizer of ``module``, the submodules whose parameters it holds, in ``module``'s child order.

    An optimizer over several submodules trains them as one engine (:mod:`lightning_multids._joined`).

    Raises:
        ValueError: an optimizer holds parameters of the LightningModule itself, or none; a parameter is in two
            optimizers; two optimizers train one submodule.
    """
    owners = parameter_owners(module)
    order = {name: position for position, (name, _) in enumerate(module.named_children())}
    seen: dict[int, int] = {}
    trained: dict[str, int] = {}
    matched: list[tuple[str, ...]] = []
    for index, optimizer in enumerate(optimizers):
        names: dict[str, None] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in seen and seen[id(param)] != index:
                    raise ValueError(
                        f"A parameter of {owners.get(id(param), 'the LightningModule')!r} is in optimizer "
                        f"{seen[id(param)]} and optimizer {index}. Each parameter can be trained by one "
                        "optimizer only: remove it from one of them in `configure_optimizers`."
                    )
                seen[id(param)] = index
                names.setdefault(_owner_of(param, owners, index))
        parts = tuple(sorted(names, key=order.__getitem__))
        _check_parts(parts, index, trained)
        trained.update(dict.fromkeys(parts, index))
        matched.append(parts)
    return matched


def _owner_of(param: torch.Tensor, owners: Mapping[int, str], index: int) -> str:
    owner = owners.get(id(param))
    if owner is None:
        raise ValueError(
            f"Optimizer {index} holds a parameter that belongs to the LightningModule itself, not to a "
            "submodule. MultiDeepSpeedStrategy builds one engine per optimizer over the submodules it trains: move "
            "the parameter into a submodule (e.g. an `nn.Module` attribute) and optimize that."
        )
    return owner


def _check_parts(parts: tuple[str, ...], index: int, trained: Mapping[str, int]) -> None:
    if not parts:
        raise ValueError(f"Optimizer {index} holds no parameters. Give it the parameters of the submodules it trains.")
    for name in parts:
        if name in trained:
            raise ValueError(
                f"Optimizers {trained[name]} and {index} both train {name!r}. MultiDeepSpeedStrategy builds one "
                "DeepSpeed engine per optimizer over the submodules it trains, and an engine has one optimizer: "
                f"train {name!r} with one optimizer (several parameter groups can give its layers their own settings)."
            )


def check_engine_names(module: nn.Module, names: Iterable[str]) -> None:
    """Raise a ValueError for an ``engine_configs`` key that is not a direct submodule of ``module``."""
    children = dict(module.named_children())
    for name in names:
        if name not in children:
            available = ", ".join(repr(c) for c in children) or "none"
            raise ValueError(
                f"`engine_configs` has an entry for {name!r}, but {type(module).__name__} has no submodule of that "
                f"name. Submodules: {available}. Key each entry by the attribute name of a submodule."
            )
