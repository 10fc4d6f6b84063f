"""Which trainable engines a loss reaches, read off its autograd graph before the backward runs.

The walk holds every node it visits (``seen`` is a set of the node objects themselves). Python's
view of an autograd node is a wrapper made when ``grad_fn``/``next_functions`` is read and freed
once nothing holds it; torch hands out the same wrapper for a node only while that wrapper is
alive. Deduplicating by ``id()`` of wrappers that were let go can take a node met later for one
already seen (a freed wrapper's address reused) and skip it: the engines behind it go missing.
Holding them makes every identity check a check on a live object.

A reentrant activation checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``,
DeepSpeed's ``checkpointing.checkpoint``) runs its forward without recording a graph; the parameters
inside it appear only when its backward recomputes the forward. The walk cannot see them, so it
says that the graph holds such a node (``Reach.hidden``); :mod:`lightning_multids.backward` then
also enters, during the backward, any engine whose gradients arrive without having been found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint


def _reentrant_checkpoint_functions() -> tuple[type, ...]:
    functions: list[type] = [torch.utils.checkpoint.CheckpointFunction]
    try:  # DeepSpeed's activation checkpointing (deepspeed 0.19.8: runtime/activation_checkpointing/checkpointing.py)
        from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction
    except ImportError:  # pragma: no cover - a DeepSpeed without it has no such nodes to find
        pass
    else:
        functions.append(CheckpointFunction)
    return tuple(functions)


_REENTRANT = _reentrant_checkpoint_functions()


@dataclass(frozen=True)
class Reach:
    """What the graph of one loss shows before its backward.

    Attributes:
        names: the trainable engines whose parameters the graph reaches.
        hidden: whether the graph holds a reentrant checkpoint, behind which more engines may be reached.
    """

    names: frozenset[str]
    hidden: bool


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
        if getattr(node, "_forward_cls", None) in _REENTRANT:
            hidden = True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return Reach(frozenset(found), hidden)
