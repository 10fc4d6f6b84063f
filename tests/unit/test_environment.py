"""What the strategy sets around DeepSpeed: the filter for torch's deprecations of DeepSpeed's ZeRO collectives
(installed where they exist, removable), the launch variables DeepSpeed reads, and where its JIT builds go."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_multids._environment import (
    EXTENSIONS_VARIABLE,
    ZERO_COLLECTIVES,
    hide_zero_deprecations,
    keep_extensions_in_environment,
    set_launch_variables,
)

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


# ---- what DeepSpeed reads of the launcher's environment, and where JIT builds go --------------------------------


def test_launch_variables_are_lightnings_ranks_and_teardown_puts_back_what_was_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # as srun leaves it
    monkeypatch.setenv("RANK", "0")  # restored by monkeypatch whatever the test leaves
    monkeypatch.setenv("WORLD_SIZE", "8")  # someone else's, to be put back
    undo = set_launch_variables(rank=3, world_size=4, local_rank=1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
    os.environ["RANK"] = "5"  # changed since: not the strategy's to undo
    undo()
    assert "LOCAL_RANK" not in os.environ
    assert os.environ["WORLD_SIZE"] == "8"
    assert os.environ["RANK"] == "5"


def test_extensions_stay_in_torchs_own_folder_where_the_environment_is_read_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(EXTENSIONS_VARIABLE, raising=False)
    prefix = tmp_path / "env"
    prefix.mkdir()
    monkeypatch.setattr(sys, "prefix", str(prefix))
    prefix.chmod(0o555)
    try:
        if os.access(prefix, os.W_OK):  # root ignores the mode bits: take the answer from the check's own input
            monkeypatch.setattr(os, "access", lambda path, mode: False)
        keep_extensions_in_environment()
        assert EXTENSIONS_VARIABLE not in os.environ
    finally:
        prefix.chmod(0o755)
    monkeypatch.undo()
    monkeypatch.delenv(EXTENSIONS_VARIABLE, raising=False)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    undo = keep_extensions_in_environment()  # writable: the environment's own folder, made at the first build
    assert os.environ[EXTENSIONS_VARIABLE] == str(prefix / "torch_extensions")
    undo()
    assert EXTENSIONS_VARIABLE not in os.environ
