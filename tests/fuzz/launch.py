"""Run fuzz cases on 2 CPU ranks (``harness.run_ranks``) and classify each against the reference.

Several cases run one after the other in one launch (``run_case.py`` fits each in turn), which saves the
launch's imports (about 15 s) per case. A launch stops at the first case that does not finish; the rest go
on in a new launch. A case that did not match after other cases in its launch is run again alone, and that
outcome is kept: a fit must not depend on the fits before it in the process (were it to, the two outcomes
would differ and the report says so).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.distributed.harness import run_ranks
from tests.fuzz import grammar, outcome, reference
from tests.fuzz.grammar import WORLD_SIZE, Case
from tests.fuzz.outcome import Outcome

RUNNER = Path(__file__).with_name("run_case.py")
PER_CASE = 15.0
"""Seconds a launch's timeout grows by for each case after its first (a case fits in 1-5 s here)."""


def run_batch(cases: list[Case], timeout: float) -> list[Outcome]:
    """Run ``cases`` in one launch: the outcomes of those that finished, then that of the first that did not."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        root = Path(tmp)
        (root / "cases.json").write_text(json.dumps([grammar.to_dict(case) for case in cases]))
        timed_out = False
        try:
            run_ranks(RUNNER, str(root / "cases.json"), tmp, timeout=timeout + PER_CASE * (len(cases) - 1))
        except AssertionError as error:
            timed_out = "did not finish within" in str(error)
        return collect(cases, root, timed_out)


def collect(cases: list[Case], root: Path, timed_out: bool) -> list[Outcome]:
    outcomes = []
    for index, case in enumerate(cases):
        results = [root / f"{index}.rank{rank}.pt" for rank in range(WORLD_SIZE)]
        if all(path.exists() for path in results):
            ranks = [torch.load(path, weights_only=False) for path in results]
            expected = reference.reference(case)
            found = outcome.compare(case, expected, ranks)
            if found.kind == "mismatch":
                with contextlib.suppress(reference.InvalidCase):  # plain PyTorch could not run it so
                    found = outcome.with_rounding_noise(found, case, expected, *reference.rounding_noise(case))
            outcomes.append(found)
            continue
        errors = [root / f"{index}.rank{rank}.error.json" for rank in range(WORLD_SIZE)]
        records = [record for path in errors if (record := read_record(path)) is not None]
        outcomes.append(outcome.from_errors(records, timed_out))
        break
    return outcomes


def read_record(path: Path) -> dict | None:
    """A rank's error record; None where there is none, or only part of one (the rank was ended while writing it,
    once another rank had failed)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_cases(cases: list[Case], timeout: float, batch: int) -> list[Outcome]:
    """Every case's outcome, ``batch`` cases per launch; one that fails after others is confirmed alone."""
    outcomes: list[Outcome | None] = [None] * len(cases)
    pending = list(range(len(cases)))
    while pending:
        chunk = pending[:batch]
        got = run_batch([cases[i] for i in chunk], timeout)
        for position, result in enumerate(got):
            if result.kind != "match" and position > 0:
                alone = run_batch([cases[chunk[position]]], timeout)[0]
                if alone.signature() != result.signature():
                    alone.detail += f" [in a launch after other cases: {result.kind}: {result.detail}]"
                result = alone
            outcomes[chunk[position]] = result
        pending = pending[len(got) :]
    return [result for result in outcomes if result is not None]


@dataclass
class Budget:
    """How many more launches the shrinker may take."""

    left: int


def first_with(signature: tuple[str, ...], cases: list[Case], timeout: float, batch: int, budget: Budget) -> int | None:
    """The index of the first of ``cases`` whose outcome has ``signature``, running them in order; or None.

    None too when ``budget`` runs out first (each launch takes one).
    """
    start = 0
    while start < len(cases) and budget.left > 0:
        budget.left -= 1
        got = run_batch(cases[start : start + batch], timeout)
        for position, result in enumerate(got):
            if result.signature() == signature:
                return start + position
        start += len(got)
    return None
