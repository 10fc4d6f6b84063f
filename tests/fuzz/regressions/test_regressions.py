"""Replay the fuzz cases kept in this folder: each must match plain PyTorch.

Each ``*.json`` here is ``{"case": <a shrunk case>, "found": <how the fuzzer classified it>, "note": <what it
seems to be>, "known_defect": <the defect not fixed yet: a number of fuzz.KNOWN_DEFECTS or a name, or null>}``
(``python -m tests.fuzz.fuzz shrink`` prints one). A case of a defect not fixed yet is expected to fail
(``xfail(strict=True)``): once the defect is fixed the test fails until ``known_defect`` is set to null.
Cases that pass run together in one 2-rank launch; an expected failure runs alone (a failing case ends its launch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fuzz import grammar, launch, reference
from tests.fuzz.grammar import Case

KEPT = sorted(Path(__file__).parent.glob("*.json"))
TIMEOUT = 150.0


def load(path: Path) -> tuple[Case, dict[str, Any]]:
    data = json.loads(path.read_text())
    case = reference.resolve(grammar.from_dict(data["case"]))
    assert case is not None, f"{path.name}: the kept case is no longer valid for the reference"
    return case, data


def expected_to_fail(path: Path) -> bool:
    return json.loads(path.read_text()).get("known_defect") is not None


def describe(path: Path) -> str:
    data = json.loads(path.read_text())
    return f"known defect {data['known_defect']}: {data['note']}"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=describe(path)), id=path.stem)
        for path in KEPT
        if expected_to_fail(path)
    ],
)
def test_kept_case_of_a_known_defect(path: Path) -> None:
    case, data = load(path)
    result = launch.run_batch([case], TIMEOUT)[0]
    assert result.kind == "match", f"{path.name} ({data['note']}): {result.kind}: {result.error_type} {result.detail}"


def test_kept_cases_match_plain_pytorch() -> None:
    paths = [path for path in KEPT if not expected_to_fail(path)]
    if not paths:
        pytest.skip("no kept case is expected to pass yet")
    cases = [load(path)[0] for path in paths]
    results = launch.run_cases(cases, TIMEOUT, batch=len(cases))
    failed = [
        f"{path.name}: {result.kind} {result.error_type} {result.detail}"
        for path, result in zip(paths, results, strict=True)
        if result.kind != "match"
    ]
    assert not failed, "\n".join(failed)
