"""Upstream lines a run prints that tell its user nothing: which ones, why, and the filters that hide them, scoped.

Nothing here is installed by ``import lightning_multids``. Each filter is narrow (the message, the category, and
where the module that warns is fixed, that module) and lives only around a call of the project's:

- While the strategy's engines live (from its ``setup`` to its ``teardown``: every fit, validate, test and
  predict), :func:`hide_upstream_warnings`:

  - :data:`ZERO_WARNING`: torch 2.13 and 2.14 deprecate ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor``, which DeepSpeed 0.19.8's ZeRO calls at every gather and reduction (torch 2.15 no
    longer does). Python's "once per place" does not hold during a fit (the registry that remembers a warning is
    cleared whenever the warning filters change), so a ZeRO-3 engine printed them at every step, over a thousand
    lines per run, about a call the user did not write and cannot change.
  - :data:`LEAF_SPEC_WARNING`: torch 2.13 deprecates ``LeafSpec``, which Lightning 2.6 builds in every
    ``CombinedLoader`` (``lightning.pytorch.utilities._pytree``): a line per process at the first loader, about
    Lightning's code.
  - :data:`EVAL_MODE_WARNING`: Lightning's "Found N module(s) in eval mode at the start of training". The
    strategy keeps frozen engines (a teacher, a reference model, an EMA) in eval mode on purpose; Lightning's
    model summary still counts the modules in eval mode.

  Each is installed only where its upstream emits it (torch marks a deprecated function or class with PEP 702's
  ``__deprecated__``), so that nothing changes the filters for nothing.
- Around the strategy's collective calls after a fit (``trainer.save_checkpoint(...)``,
  ``strategy.consolidated_state_dict()``, which gather ZeRO-3 partitions), :func:`zero_deprecations_hidden`: the
  ZeRO deprecations alone, once per such call; inside a fit the filter is there already and nothing changes.
- Around the whole ``lightning-multids`` command, :func:`quiet`: all of the above, and Lightning's two tips
  (:data:`LIGHTNING_TIPS`) to install ``litlogger`` (at ``Trainer(...)``) and ``litmodels`` (at the start of fit,
  where no ``ModelCheckpoint`` is given), which come before the strategy starts.

What may still appear is listed in ``docs/errors.md``.
"""

from __future__ import annotations

import logging
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import cast

import torch.distributed
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning_utilities.core import rank_zero

from lightning_multids._compat.torch import leaf_spec_deprecated


@dataclass(frozen=True)
class Known:
    """An upstream warning hidden while it says nothing to the user: what the filter matches, and when it is due."""

    message: str
    """A regex the message must match from its start (as ``warnings.filterwarnings`` reads it)."""
    category: type[Warning]
    module: str
    """A regex of the module that warns, ``""`` where it differs between upstream versions."""
    emitted: Callable[[], bool]
    """Whether the installed upstream emits it: no filter is installed where it does not."""


ZERO_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
"""The torch 2.13 deprecations that DeepSpeed 0.19.8's ZeRO collectives trigger (``torch/distributed``)."""

ZERO_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


def _zero_collectives_deprecated() -> bool:
    return any(hasattr(getattr(torch.distributed, name, None), "__deprecated__") for name in ZERO_COLLECTIVES)


def _always() -> bool:
    return True


ZERO_WARNING = Known(ZERO_DEPRECATIONS, FutureWarning, "", _zero_collectives_deprecated)
"""No module: where torch's deprecation is raised from (its logging wrapper, or DeepSpeed's call) varies by release."""

LEAF_SPEC_WARNING = Known(
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    FutureWarning,
    r"lightning\.pytorch\.utilities\._pytree\Z",
    leaf_spec_deprecated,
)
EVAL_MODE_WARNING = Known(
    r"Found \d+ module\(s\) in eval mode at the start of training",
    PossibleUserWarning,
    r"lightning\.pytorch\.loops\.fit_loop\Z",
    _always,
)
WHILE_ENGINES_LIVE = (ZERO_WARNING, LEAF_SPEC_WARNING, EVAL_MODE_WARNING)

LIGHTNING_TIPS = re.compile(r"💡 Tip: .* try installing \[(litlogger|litmodels)\]")
"""Lightning 2.6's tips to install its cloud logger and model registry (``rank_zero_info``: Python logging)."""


def hide_warnings(*known: Known) -> Callable[[], None]:
    """Stop showing the warnings ``known`` (those their upstream emits); return what shows them again.

    A filter already there (the user's, or an outer call's) is left as it is, and stays theirs to remove: the
    filters are not touched for it (every change clears Python's record of the warnings already shown once).
    """
    added = []
    for warning in known:
        if not warning.emitted():
            continue
        entry = ("ignore", re.compile(warning.message, re.I), warning.category, _module(warning.module), 0)
        if entry in warnings.filters:
            continue
        warnings.filterwarnings("ignore", message=warning.message, category=warning.category, module=warning.module)
        added.append(warnings.filters[0])

    def show_again() -> None:
        for entry in added:
            with suppress(ValueError):  # already gone, e.g. the user reset the filters
                cast(list, warnings.filters).remove(entry)  # a list at run time; typeshed says Sequence
        added.clear()

    return show_again


def _module(pattern: str) -> re.Pattern[str] | None:
    return re.compile(pattern) if pattern else None


def hide_upstream_warnings() -> Callable[[], None]:
    """Hide :data:`WHILE_ENGINES_LIVE` (the strategy's ``setup`` to its ``teardown``); return what shows them again."""
    return hide_warnings(*WHILE_ENGINES_LIVE)


@contextmanager
def zero_deprecations_hidden() -> Iterator[None]:
    """Hide :data:`ZERO_WARNING` inside the block (a gather of ZeRO-3 partitions after fit)."""
    show_again = hide_warnings(ZERO_WARNING)
    try:
        yield
    finally:
        show_again()


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return LIGHTNING_TIPS.match(record.getMessage()) is None


def drop_lightning_tips() -> Callable[[], None]:
    """Drop :data:`LIGHTNING_TIPS` from Lightning's rank-zero logger (``rank_zero_info``'s) until the undo runs."""
    logger, drop = rank_zero.log, _DropTips()
    logger.addFilter(drop)
    return lambda: logger.removeFilter(drop)


_TIPS_DROPPED: weakref.WeakKeyDictionary[object, weakref.finalize] = weakref.WeakKeyDictionary()


def drop_lightning_tips_for(owner: object) -> None:
    """Drop :data:`LIGHTNING_TIPS` until :func:`show_lightning_tips_of` ``owner`` runs, or ``owner`` is collected.

    Kept here, not on ``owner``, so that ``owner`` (the strategy) stays picklable for a spawned launch.
    """
    _TIPS_DROPPED[owner] = weakref.finalize(owner, drop_lightning_tips())


def show_lightning_tips_of(owner: object) -> None:
    """Undo :func:`drop_lightning_tips_for` ``owner``, where it is in force."""
    undo = _TIPS_DROPPED.pop(owner, None)
    if undo is not None:
        undo()


@contextmanager
def quiet() -> Iterator[None]:
    """Hide :data:`WHILE_ENGINES_LIVE` and drop :data:`LIGHTNING_TIPS` inside the block (the command's whole call)."""
    show_tips = drop_lightning_tips()
    show_again = hide_upstream_warnings()
    try:
        yield
    finally:
        show_again()
        show_tips()
