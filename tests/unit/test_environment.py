"""The filter for torch's deprecations of DeepSpeed's ZeRO collectives: installed where they exist, removable."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from lightning_multids._environment import ZERO_COLLECTIVES, hide_zero_deprecations

MESSAGES = [f"`torch.distributed.{name}` is deprecated. Please use another." for name in ZERO_COLLECTIVES]
OTHER = "`torch.distributed.broadcast` is deprecated."


def shown(messages: list[str]) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # show the rest: moved behind the filter under test
        warnings.filters.append(warnings.filters.pop(0))
        for message in messages:
            warnings.warn(message, FutureWarning, stacklevel=1)
    return [str(w.message) for w in seen]


def deprecated(monkeypatch: pytest.MonkeyPatch, marked: bool) -> None:
    """Make torch.distributed's two collectives look as torch 2.13/2.14 (marked) or 2.11/2.15 (not) have them."""
    for name in ZERO_COLLECTIVES:

        def collective(*args: object) -> None: ...

        if marked:
            collective.__deprecated__ = "deprecated"  # type: ignore[attr-defined]
        monkeypatch.setattr(torch.distributed, name, collective)


def test_hidden_where_torch_deprecates_them_and_shown_again_after(monkeypatch: pytest.MonkeyPatch) -> None:
    deprecated(monkeypatch, marked=True)
    with warnings.catch_warnings():
        show_again: Callable[[], None] = hide_zero_deprecations()
        assert shown([*MESSAGES, OTHER]) == [OTHER]
        show_again()
        assert shown(MESSAGES) == MESSAGES
        show_again()  # twice: nothing left to remove, no error


def test_nothing_installed_where_torch_does_not_deprecate_them(monkeypatch: pytest.MonkeyPatch) -> None:
    deprecated(monkeypatch, marked=False)
    with warnings.catch_warnings():
        before = list(warnings.filters)
        hide_zero_deprecations()()
        assert list(warnings.filters) == before
        hide_zero_deprecations()
        assert list(warnings.filters) == before


def test_a_filter_that_was_there_already_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same filter set before (by the user, or an outer fit) is theirs: removing ours must not take it."""
    deprecated(monkeypatch, marked=True)
    with warnings.catch_warnings():
        outer = hide_zero_deprecations()
        hide_zero_deprecations()()
        assert shown(MESSAGES) == []
        outer()
        assert shown(MESSAGES) == MESSAGES
