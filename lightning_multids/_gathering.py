"""A ZeRO-3 engine's submodule whole for a block: generation and evaluation without per-layer gathering.

Under ZeRO-3 each forward of a submodule gathers its parameters and releases them after it, layer by layer. An
autoregressive ``generate`` runs the model once per token, so it gathers the whole model once per token, each
layer in its own collective. :func:`gathered` gathers it once for a block instead, takes ZeRO-3's per-layer
hooks off so the block runs it as a plain module, and partitions it again at the end (as TRL's
``unwrap_model_for_generation`` does). The cost: the whole submodule, in its engine's dtype, on every rank
during the block.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableSet, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.utils import is_zero_param
from torch import nn

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._optimizer import EngineOptimizer


class Arrival:
    """Every rank checks in before a block's collectives, within a bounded time, in a gloo group of its own.

    A block entered on some ranks only (e.g. under ``if self.global_rank == 0``) would otherwise wait in its first
    all-gather until the process group's timeout (30 minutes by default), or meet another collective of the ranks
    that went on and exchange the wrong tensors. The check-in is an all-gather of the block's name (a checksum) in
    a gloo group whose timeout is ``timeout``: it never meets the blocks' own collectives, whatever the backend, and
    it fails on every rank that waits. (``torch.distributed.monitored_barrier`` bounds the wait on rank 0 only.)
    Creating the group is a collective: every rank does it at the same point of setup.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.group = torch.distributed.new_group(backend="gloo", timeout=timeout)

    def __call__(self, block: str) -> None:
        """Wait until every rank is at ``block``; raise a RuntimeError after ``timeout``, or if a rank is elsewhere."""
        mine = torch.tensor([zlib.crc32(block.encode())], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size(self.group))]
        try:
            torch.distributed.all_gather(everyone, mine, group=self.group)
        except RuntimeError as error:
            raise RuntimeError(
                f"`{block}` did not meet every rank within {self.timeout} ({error}). It gathers the ZeRO-3 "
                "engine's partitions from every rank, so every rank must enter it, at the same point: don't put it "
                "under a condition that differs between ranks (such as `if self.global_rank == 0`). If some ranks "
                "only arrive later, raise `MultiDeepSpeedStrategy(gathered_timeout=...)`."
            ) from error
        elsewhere = [rank for rank, code in enumerate(everyone) if not torch.equal(code, mine)]
        if elsewhere:
            raise RuntimeError(
                f"`{block}`: rank(s) {elsewhere} entered another block at the same time. Every rank must enter the "
                "same `gathered` blocks in the same order."
            )

    def close(self) -> None:
        """Destroy the group (no collective)."""
        torch.distributed.destroy_process_group(self.group)


@contextmanager
def gathered(
    name: str,
    engines: Mapping[str, DeepSpeedEngine],
    active: MutableSet[str],
    optimizers: Sequence[EngineOptimizer],
    arrive: Callable[[str], None] | None = None,
) -> Iterator[nn.Module]:
    """Make engine ``name``'s submodule whole on this rank for the block, under ``torch.no_grad()``; yield it.

    A collective call: every rank enters the block (the gathering and the partitioning are all-gathers). At
    ZeRO-0/1/2 the submodule is whole already and only ``no_grad`` applies. ``active`` holds the names of
    the engines inside such a block (nesting one is refused); a trained engine's optimizer (in ``optimizers``)
    refuses to step inside it. ``arrive(block)``, where given, returns once every rank is at the block (an
    :class:`Arrival`), and is called before the gathering.

    Raises:
        ValueError: there is no engine ``name``, or it is already inside a block.
    """
    if name not in engines:
        raise ValueError(
            f"`gathered({name!r})`: there is no engine {name!r} now (engines: {sorted(engines)}). Engines exist "
            "from setup to teardown of fit, validate, test and predict; name a submodule that has one."
        )
    optimizer = next((o for o in optimizers if o.name == name), None)
    if name in active or (optimizer is not None and optimizer.inside):
        block = optimizer.inside if optimizer is not None and optimizer.inside else f"strategy.gathered({name!r})"
        raise ValueError(f"`gathered({name!r})`: the engine is inside `{block}` already; don't nest them.")
    engine = engines[name]
    params = [param for param in engine.module.parameters() if is_zero_param(param)]
    if params and arrive is not None:
        arrive(f"strategy.gathered({name!r})")
    active.add(name)
    if optimizer is not None:
        optimizer.inside = f"strategy.gathered({name!r})"
    try:
        with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            restore = ds_compat.suspend_zero3_hooks(engine) if params else None
            try:
                yield engine.module
            finally:
                if restore is not None:
                    restore()
    finally:
        active.discard(name)
        if optimizer is not None:
            optimizer.inside = ""


def whole(params: Iterable[nn.Parameter]) -> AbstractContextManager:
    """``deepspeed.zero.GatheredParameters`` over those of ``params`` ZeRO-3 holds partitioned now; a collective call.

    Inside :func:`gathered` a submodule's parameters are whole already, and DeepSpeed refuses to gather them again
    ("Nested GatheredParameters contexts cannot overlap"); they are read as they are. So are the small ones ZeRO-3
    keeps whole between forwards. Every rank is in the same blocks, so every rank gathers the same list.
    """
    partitioned = [param for param in params if is_zero_param(param) and not ds_compat.is_gathered(param)]
    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None, enabled=bool(partitioned))
