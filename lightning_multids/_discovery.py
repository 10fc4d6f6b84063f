"""Discovery: which submodule each optimizer trains (at setup), and which engines a loss reaches (per backward).

Engines are found from the optimizers of ``configure_optimizers``: each trains the direct child of the
LightningModule that holds its parameters (:func:`match_optimizers`). A loss reaches the engines whose
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
    """Return ``submodule name -> index of its optimizer`` for the optimizers of ``module``.

    Raises:
        ValueError: an optimizer holds parameters of several submodules, or of the LightningModule
            itself; a parameter is in two optimizers; two optimizers train one submodule.
    """
    owners = parameter_owners(module)
    seen: dict[int, int] = {}
    matched: dict[str, int] = {}
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
        matched.update(_one_submodule(names, index, matched))
    return matched


def _owner_of(param: torch.Tensor, owners: Mapping[int, str], index: int) -> str:
    owner = owners.get(id(param))
    if owner is None:
        raise ValueError(
            f"Optimizer {index} holds a parameter that belongs to the LightningModule itself, not to a "
            "submodule. MultiDeepSpeedStrategy builds one engine per submodule: move the parameter into a "
            "submodule (e.g. an `nn.Module` attribute) and optimize that."
        )
    return owner


def _one_submodule(names: Mapping[str, None], index: int, matched: Mapping[str, int]) -> dict[str, int]:
    if not names:
        raise ValueError(f"Optimizer {index} holds no parameters. Give it the parameters of one submodule.")
    if len(names) > 1:
        listed = " and ".join(repr(n) for n in names)
        raise ValueError(
            f"Optimizer {index} holds parameters of {listed}. MultiDeepSpeedStrategy gives each submodule its "
            "own DeepSpeed engine and optimizer: return one optimizer per submodule from "
            "`configure_optimizers`, or put the parts in one parent submodule."
        )
    (name,) = names
    if name in matched:
        raise ValueError(
            f"Optimizers {matched[name]} and {index} both train {name!r}. A DeepSpeed engine has one "
            "optimizer: use one optimizer with several parameter groups for this submodule."
        )
    return {name: index}


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
