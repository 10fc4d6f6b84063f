"""The real-code harness's own logic, in pytest's process: which setups a run compares, and how states compare."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tests.realcode.harness import STAGES_VARIABLE, Case, Launched, assert_matches_ddp, differences, run_setups


def nothing() -> pl.LightningModule:
    return pl.LightningModule()


@pytest.mark.parametrize(
    ("chosen", "mixed", "expected"),
    [
        ("", {"teacher": 3}, ["zero3", "mixed"]),
        ("", None, ["zero3"]),
        ("all", {"teacher": 3}, ["zero0", "zero2", "zero3", "mixed"]),
        ("all", None, ["zero0", "zero2", "zero3"]),
        ("zero2, mixed", {"teacher": 3}, ["zero2", "mixed"]),
    ],
)
def test_a_run_compares_the_setups_it_asks_for(
    monkeypatch: pytest.MonkeyPatch, chosen: str, mixed: dict[str, int] | None, expected: list[str]
) -> None:
    monkeypatch.setenv(STAGES_VARIABLE, chosen)
    assert run_setups(Case(build=nothing, mixed=mixed)) == expected


def test_a_case_names_its_ci_setups_and_an_unknown_setup_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STAGES_VARIABLE, raising=False)
    assert run_setups(Case(build=nothing, ci=("zero2", "zero3"))) == ["zero2", "zero3"]
    monkeypatch.setenv(STAGES_VARIABLE, "zero1")
    with pytest.raises(ValueError, match="unknown setups"):
        run_setups(Case(build=nothing))


def test_every_tensor_is_compared_and_a_moment_never_stepped_is_skipped() -> None:
    ddp = {"w": torch.ones(2), "optimizer/w/exp_avg": torch.ones(2)}
    assert differences(ddp, ddp | {"optimizer/v/exp_avg": torch.zeros(3)}) == {"w": 0.0, "optimizer/w/exp_avg": 0.0}
    assert differences(ddp, ddp | {"optimizer/v/exp_avg": torch.ones(3)})["optimizer/v/exp_avg"] == float("inf")
    assert differences(ddp, {"w": torch.ones(2)})["optimizer/w/exp_avg"] == float("inf")
    assert differences(ddp, ddp | {"w": torch.ones(1, 2)})["w"] == float("inf")


def test_a_difference_over_the_tolerance_or_a_failed_fit_fails() -> None:
    ddp = {"state": {"w": torch.zeros(2)}}
    launched: Launched = {"ddp": ddp, "close": {"state": {"w": torch.full((2,), 1e-6)}}}
    assert_matches_ddp(launched, "close")
    launched["far"] = {"state": {"w": torch.tensor([0.0, 2e-5])}}
    with pytest.raises(AssertionError, match="w: off by 2e-05"):
        assert_matches_ddp(launched, "far")
    launched["raised"] = {"error": "Traceback ...\nValueError: no"}
    with pytest.raises(pytest.fail.Exception, match="ValueError: no"):
        assert_matches_ddp(launched, "raised")
