"""EMA engines: a frozen submodule that keeps an exponential moving average of a trained one.

``MultiDeepSpeedStrategy(ema={"generator_ema": ("generator", 0.999)})`` makes ``self.generator_ema`` a frozen
engine at its own ZeRO stage and, after every applied ``opt.step()`` of the ``generator`` engine, averages it as
``torch.optim.swa_utils.AveragedModel(generator, multi_avg_fn=get_ema_multi_avg_fn(0.999))`` would: the first
update copies the weights, each later one moves them ``1 - decay`` of the way to the source's
(``ema.lerp_(source, 1 - decay)``). Buffers are copied from the source at every update, as ``AveragedModel`` does
with ``use_buffers=False``. At setup the average starts as a copy of the source, as ``AveragedModel``'s deep copy
does.

The update needs no communication where both engines are at ZeRO-3 (each rank averages its own partition) or
where only the average is (each rank takes its partition's elements from the whole source); a ZeRO-3 source is
gathered for a whole average, one module at a time. An average keeps fp32 weights: at ``decay=0.999`` a step moves
a weight by a thousandth of its distance to the source, below a bf16 weight's resolution.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.runtime.zero.utils import is_zero_param
from torch import nn

from lightning_multids._blocks import whole
from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._config import merge

EmaArgument = Mapping[str, "tuple[str, float] | list[Any]"]
"""``{average_name: (source_name, decay)}``, as ``MultiDeepSpeedStrategy(ema=...)`` takes it."""


@dataclass(frozen=True)
class Average:
    """The submodule ``name`` averages the trained submodule ``source`` with ``decay``."""

    name: str
    source: str
    decay: float


def parse_averages(ema: EmaArgument | None) -> dict[str, Average]:
    """Check ``MultiDeepSpeedStrategy(ema=...)`` and return one :class:`Average` per entry.

    Raises:
        ValueError: an entry is not ``(source_name, decay)`` with ``0 <= decay < 1``, averages itself, or
            averages another average.
    """
    averages = {}
    for name, value in (ema or {}).items():
        source, decay = _source_and_decay(name, value)
        if source == name:
            raise ValueError(f"`ema={{{name!r}: ...}}` averages {name!r} into itself. Name the trained submodule.")
        averages[name] = Average(name, source, decay)
    chained = [a.name for a in averages.values() if a.source in averages]
    if chained:
        raise ValueError(
            f"`ema=`: {chained} average another average, which has no optimizer step to follow. Average the "
            "trained submodule itself."
        )
    return averages


def _source_and_decay(name: str, value: Any) -> tuple[str, float]:
    example = f"`ema={{{name!r}: ('generator', 0.999)}}`"
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not isinstance(value[0], str):
        raise ValueError(f"`ema=` entry {name!r} is {value!r}; give it as (source submodule, decay): {example}.")
    try:
        decay = float(value[1])
    except (TypeError, ValueError):
        raise ValueError(f"`ema=` entry {name!r} has the decay {value[1]!r}, not a number: {example}.") from None
    if not 0.0 <= decay < 1.0:
        raise ValueError(
            f"`ema=` entry {name!r} has decay {decay}; it must be in [0, 1) (each update keeps `decay` of the "
            f"average and takes `1 - decay` of the source; 0.999 is usual): {example}."
        )
    return value[0], decay


def average_entries(
    averages: Mapping[str, Average], entries: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``engine_configs`` with an entry for every average, which keeps it in fp32 and refuses an optimizer.

    Raises:
        ValueError: an average's config has an optimizer or enables bf16/fp16 (an average keeps fp32 weights).
    """
    result = {name: dict(entry) for name, entry in entries.items()}
    for name in averages:
        entry = result.get(name, {})
        if "optimizer" in entry:
            raise ValueError(
                f"The EMA engine {name!r} (`ema=`) has an `optimizer` section in its DeepSpeed config. An average "
                "is updated from its source, not trained: remove the section."
            )
        half = [key for key in ("bf16", "fp16") if isinstance(entry.get(key), Mapping) and entry[key].get("enabled")]
        if half:
            raise ValueError(
                f"The DeepSpeed config for the EMA engine {name!r} enables {half[0]}. An average keeps fp32 weights "
                "(at decay 0.999 an update moves a weight below a 16-bit weight's resolution): remove the "
                f"`{half[0]}` section from its entry; its submodule runs in fp32."
            )
        result[name] = merge(entry, {"bf16": {"enabled": False}, "fp16": {"enabled": False}})
    return result


@dataclass
class Averager:
    """The averages of one fit: updates them after their sources' steps, and counts the updates."""

    averages: dict[str, Average]
    modules: dict[str, tuple[nn.Module, nn.Module]]
    """``name -> (average submodule, source submodule)``."""
    updates: dict[str, int] = field(default_factory=dict)
    """How many times each average was updated (0: the next update copies), saved with checkpoints."""

    def after_step(self, source: str) -> None:
        """Update every average of ``source`` after an applied step of its engine; a collective call."""
        for average in self.averages.values():
            if average.source == source:
                self.update(average.name)

    def update(self, name: str) -> None:
        """Move the average ``name`` towards its source (copy it on the first update); a collective call."""
        done = self.updates.get(name, 0)
        weight = 1.0 if done == 0 else 1.0 - self.averages[name].decay
        average, source = self.modules[name]
        move_towards(average, source, weight)
        self.updates[name] = done + 1

    def start(self) -> None:
        """Make every average a copy of its source, as at the start of a fit; a collective call."""
        for name in self.averages:
            self.restart(name)

    def restart(self, name: str) -> None:
        """Make the average ``name`` a copy of its source again, as at setup; a collective call."""
        average, source = self.modules[name]
        move_towards(average, source, 1.0)
        self.updates[name] = 0

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps besides the averages' weights: their update counts."""
        return dict(self.updates)

    def load_state(self, saved: Mapping[str, int]) -> None:
        """Restore the update counts of the averages a checkpoint holds; the others restart from their source."""
        for name in self.averages:
            if name in saved:
                self.updates[name] = int(saved[name])
            else:
                self.restart(name)


def check_average_names(averages: Mapping[str, Average], module: nn.Module) -> None:
    """Raise a ValueError for an ``ema=`` average that is not a direct submodule of ``module``."""
    children = dict(module.named_children())
    for name in averages:
        if name not in children:
            raise ValueError(
                f"`ema=` names {name!r}, but {type(module).__name__} has no submodule of that name. Add it "
                f"(`self.{name} = copy.deepcopy(self.{averages[name].source})` in `__init__`) or fix the name."
            )


def check_averages(
    averages: Mapping[str, Average],
    module: nn.Module,
    trainable: Collection[str],
    configs: Mapping[str, Mapping[str, Any]],
    joined: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Refuse averages that cannot follow their source, before any engine is built.

    Args:
        averages: the strategy's ``ema=``.
        module: the LightningModule.
        trainable: the names of the engines that will train.
        configs: every engine's resolved DeepSpeed config.
        joined: the parts of each engine over several submodules (:mod:`lightning_multids._joined`), by its name.

    Raises:
        ValueError: a source is not a trainable engine or is part of one over several submodules, an average is
            trained, their parameters differ, or one of them offloads to NVMe.
    """
    for average in averages.values():
        name, source = average.name, average.source
        for engine, parts in (joined or {}).items():
            if source in parts:
                raise ValueError(
                    f"The EMA engine {name!r} averages {source!r}, which one optimizer trains with "
                    f"{', '.join(repr(p) for p in parts if p != source)} as the engine {engine!r}: an average of part "
                    "of such an engine is not supported. Give the source its own optimizer in "
                    "`configure_optimizers` (its own engine), or keep the average yourself in `on_train_batch_end`."
                )
        if name in trainable:
            raise ValueError(
                f"The EMA engine {name!r} (`ema=`) has an optimizer (from `configure_optimizers`, or an `optimizer` "
                f"section in the strategy's `config`). An average follows its source: stop returning an optimizer "
                f"over `self.{name}.parameters()`, or move the `optimizer` section into the trained engines' entries."
            )
        if source not in trainable:
            raise ValueError(
                f"The EMA engine {name!r} averages {source!r}, which is not a trainable engine (trainable: "
                f"{sorted(trainable)}). Name a submodule that an optimizer trains."
            )
        _check_same_parameters(name, source, module)
        nvme = [m for m in (name, source) if _offload_device(configs[m]) == "nvme"]
        if nvme:
            raise ValueError(
                f"The EMA engine {name!r}: {nvme} offload parameters to NVMe (`offload_param.device: nvme`), where "
                "the average cannot update them in place. Offload them to the CPU (`device: cpu`) instead."
            )


def _check_same_parameters(name: str, source: str, module: nn.Module) -> None:
    ours = {key: ds_compat.full_shape(p) for key, p in getattr(module, name).named_parameters()}
    theirs = {key: ds_compat.full_shape(p) for key, p in getattr(module, source).named_parameters()}
    if ours != theirs:
        differ = sorted(set(ours) ^ set(theirs)) or [key for key in ours if ours[key] != theirs[key]]
        raise ValueError(
            f"The EMA engine {name!r} cannot average {source!r}: their parameters differ ({differ[:3]}). Build "
            f"`self.{name}` as a copy of `self.{source}` (e.g. `copy.deepcopy(self.{source})` in `__init__`)."
        )


def _offload_device(config: Mapping[str, Any]) -> str | None:
    zero = config.get("zero_optimization", {})
    if zero.get("stage") != 3:
        return None
    return (zero.get("offload_param") or {}).get("device")


def build_averager(averages: Mapping[str, Average], module: nn.Module) -> Averager | None:
    """The :class:`Averager` of ``averages`` (checked by :func:`check_averages`), or None without any."""
    if not averages:
        return None
    modules = {a.name: (getattr(module, a.name), getattr(module, a.source)) for a in averages.values()}
    return Averager(dict(averages), modules)


@torch.no_grad()
def move_towards(average: nn.Module, source: nn.Module, weight: float) -> None:
    """``average = average + weight * (source - average)`` parameter-wise, at any ZeRO stages; copy the buffers.

    A collective call when ``source`` is at ZeRO-3 and must be gathered (see the module's docstring).
    """
    pairs = list(zip(average.parameters(), source.parameters(), strict=True))
    by_partition = [is_zero_param(a) and not ds_compat.is_gathered(a) for a, _ in pairs]
    from_partition = [
        local and is_zero_param(s) and ds_compat.same_partitioning(a, s)
        for (a, s), local in zip(pairs, by_partition, strict=True)
    ]
    gather = [s for (_, s), direct in zip(pairs, from_partition, strict=True) if is_zero_param(s) and not direct]
    with whole(gather):  # the same list on every rank: ZeRO-3 gathers and releases alike on every rank
        for (a, s), local, direct in zip(pairs, by_partition, from_partition, strict=True):
            if local:
                part, start = ds_compat.partition(a)
                values = ds_compat.partition(s)[0] if direct else s.data.view(-1)[start : start + part.numel()]
                part.lerp_(values.to(device=part.device, dtype=part.dtype), weight)
                continue
            a.data.lerp_(s.data.to(a.dtype), weight)
            if is_zero_param(a):  # whole now and partitioned beside: the partition gets the same values
                part, start = ds_compat.partition(a)
                part.copy_(a.data.view(-1)[start : start + part.numel()])
    for mine, theirs in zip(average.buffers(), source.buffers(), strict=True):
        mine.copy_(theirs)
