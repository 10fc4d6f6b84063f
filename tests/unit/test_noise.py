"""Upstream warnings that tell the user nothing, hidden only around the project's calls: each where its upstream
emits it (the real emitters where cheap), shown again after, and a filter that was there already left as it is."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.utilities._pytree import _tree_flatten
from lightning_utilities.core import rank_zero
from torch import nn

from lightning_multids import checkpoint
from lightning_multids._compat.torch import leaf_spec_deprecated
from lightning_multids._noise import (
    ZERO_COLLECTIVES,
    ZERO_WARNING,
    hide_upstream_warnings,
    hide_warnings,
    quiet,
)

ZERO_MESSAGES = [f"`torch.distributed.{name}` is deprecated. Please use another." for name in ZERO_COLLECTIVES]
OTHER = "`torch.distributed.broadcast` is deprecated."


def shown(emit: Callable[[], None]) -> list[str]:
    """What ``emit`` warns that the filters in place let through (the rest shown, behind them)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        warnings.filters.append(warnings.filters.pop(0))
        emit()
    return [str(w.message) for w in seen]


def warn_all(*messages: str) -> Callable[[], None]:
    def emit() -> None:
        for message in messages:
            warnings.warn(message, FutureWarning, stacklevel=1)

    return emit


def leaf_spec() -> None:
    """What Lightning's CombinedLoader does: flatten its iterables (torch 2.13 then warns of ``LeafSpec``)."""
    _tree_flatten(1)


def eval_mode() -> None:
    """Lightning's check at the start of fit, of a module in eval mode (a frozen engine's)."""
    _FitLoop._warn_if_modules_in_eval_mode(
        SimpleNamespace(trainer=SimpleNamespace(lightning_module=nn.Linear(1, 1).eval()))
    )  # type: ignore[arg-type]


def deprecated(monkeypatch: pytest.MonkeyPatch, marked: bool) -> None:
    """Make torch.distributed's two collectives look as torch 2.13/2.14 (marked) or 2.11/2.15 (not) have them."""
    for name in ZERO_COLLECTIVES:

        def collective(*args: object) -> None: ...

        if marked:
            collective.__deprecated__ = "deprecated"  # type: ignore[attr-defined]
        monkeypatch.setattr(torch.distributed, name, collective)


def test_zero_deprecations_hidden_where_torch_has_them_and_shown_again_after(monkeypatch: pytest.MonkeyPatch) -> None:
    deprecated(monkeypatch, marked=True)
    with warnings.catch_warnings():
        show_again = hide_warnings(ZERO_WARNING)
        assert shown(warn_all(*ZERO_MESSAGES, OTHER)) == [OTHER]
        show_again()
        assert shown(warn_all(*ZERO_MESSAGES)) == ZERO_MESSAGES
        show_again()  # twice: nothing left to remove, no error


def test_no_zero_filter_where_torch_does_not_deprecate_them(monkeypatch: pytest.MonkeyPatch) -> None:
    deprecated(monkeypatch, marked=False)
    with warnings.catch_warnings():
        before = list(warnings.filters)
        hide_warnings(ZERO_WARNING)()
        assert list(warnings.filters) == before
        hide_warnings(ZERO_WARNING)
        assert list(warnings.filters) == before


def test_a_filter_that_was_there_already_stays_and_the_filters_are_not_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same filter set before (by the user, or an outer fit) is theirs: removing ours must not take it."""
    deprecated(monkeypatch, marked=True)
    with warnings.catch_warnings():
        outer = hide_upstream_warnings()
        filters = list(warnings.filters)
        inner = hide_upstream_warnings()
        assert list(warnings.filters) == filters
        inner()
        assert list(warnings.filters) == filters
        assert shown(warn_all(*ZERO_MESSAGES)) == [] and shown(leaf_spec) == [] and shown(eval_mode) == []
        outer()
        assert shown(warn_all(*ZERO_MESSAGES)) == ZERO_MESSAGES


def test_lightnings_leaf_spec_and_eval_mode_warnings_are_hidden_while_the_strategys_engines_live() -> None:
    """The strategy's setup calls ``hide_upstream_warnings`` (its teardown, what it returns)."""
    with warnings.catch_warnings():
        before_leaf_spec, before_eval_mode = shown(leaf_spec), shown(eval_mode)
        assert any("in eval mode at the start of training" in line for line in before_eval_mode), before_eval_mode
        assert any("LeafSpec" in line for line in before_leaf_spec) == leaf_spec_deprecated(), before_leaf_spec
        show_again = hide_upstream_warnings()
        assert shown(leaf_spec) == [] and shown(eval_mode) == []
        show_again()
        assert shown(leaf_spec) == before_leaf_spec and shown(eval_mode) == before_eval_mode


def test_zero_gathers_after_fit_are_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """``consolidated_state_dict()`` after fit gathers ZeRO-3 partitions outside the strategy's filter."""
    deprecated(monkeypatch, marked=True)

    @contextmanager
    def whole(params: object) -> Iterator[None]:  # a gather: torch warns of DeepSpeed's collective
        warnings.warn(ZERO_MESSAGES[0], FutureWarning, stacklevel=1)
        yield

    monkeypatch.setattr(checkpoint, "whole", whole)
    module = nn.Linear(1, 1)
    module.weight.ds_id = 0  # type: ignore[attr-defined]  # what DeepSpeed's is_zero_param looks for
    with warnings.catch_warnings():
        filters = list(warnings.filters)
        assert shown(lambda: checkpoint.gathered_state_dict(module)) == []
        assert list(warnings.filters) == filters


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_command_drops_lightnings_tips_only_inside_its_call() -> None:
    handler = Lines()
    rank_zero.log.addHandler(handler)
    try:
        kwargs = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        before = list(rank_zero.log.filters)  # a strategy another test left uncollected may drop them too
        with quiet():
            pl.Trainer(**kwargs)  # type: ignore[arg-type]
        assert not [line for line in handler.lines if "Tip" in line], handler.lines
        assert rank_zero.log.filters == before
        rank_zero.log.filters, others = [], before
        try:
            pl.Trainer(**kwargs)  # type: ignore[arg-type]
        finally:
            rank_zero.log.filters = others
        assert [line for line in handler.lines if "try installing [litlogger]" in line], handler.lines
    finally:
        rank_zero.log.removeHandler(handler)
