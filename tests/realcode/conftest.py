"""The ``launched`` fixture: one 2-rank launch per case module (see ``harness.py``); the verdicts at the end."""

from __future__ import annotations

import pytest

from tests.realcode.harness import Launched, launch, verdict

_VERDICTS: dict[str, Launched] = {}


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest) -> Launched:
    """The module's ``CASE`` fitted under DDP and each setup of this run, in one launch: rank 0's outcomes."""
    outcomes = launch(request.module.__name__, request.module.CASE)
    _VERDICTS[request.module.__name__] = outcomes
    return outcomes


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each case's setups against DDP, with each fit's seconds on rank 0."""
    if not _VERDICTS:
        return
    terminalreporter.section("real code against DDP")
    for module, outcomes in _VERDICTS.items():
        for setup, outcome in outcomes.items():
            seconds = f"{outcome['seconds']:.1f} s" if "seconds" in outcome else "-"
            line = "reference" if setup == "ddp" else verdict(outcomes, setup)
            terminalreporter.write_line(f"{module.rsplit('.', 1)[-1]} {setup}: {line} [{seconds}]")
