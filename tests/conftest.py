"""Every test leaves the pytest process as it found it; ``--one-per-file`` picks the fast local loop's tests.

2-rank tests cannot leak into each other: each launch forks its ranks anew from a fork server that runs no test
code (``tests/distributed/harness.py``). Tests that run in pytest's own process can: :func:`leaves_no_state` fails
a test that leaves an environment variable set or changed, a process group open, or torch's default dtype,
gradient mode or determinism flag changed, so that it is found where it happened rather than in whatever test
runs next.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

IGNORED_VARIABLES = {"PYTEST_CURRENT_TEST"}
"""Set and changed by pytest itself around every test."""


def process_state() -> dict[str, Any]:
    """What a test could leave behind in this process, as comparable values."""
    return {
        "environment": {key: value for key, value in os.environ.items() if key not in IGNORED_VARIABLES},
        "process group": torch.distributed.is_available() and torch.distributed.is_initialized(),
        "default dtype": torch.get_default_dtype(),
        "gradient mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def leaked(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two :func:`process_state` readings, one line each."""
    lines = []
    for name in before:
        if name == "environment":
            changed = sorted(
                key for key in before[name].keys() | after[name].keys() if before[name].get(key) != after[name].get(key)
            )
            lines += [
                f"environment variable {key}: {before[name].get(key)!r} -> {after[name].get(key)!r}" for key in changed
            ]
        elif before[name] != after[name]:
            lines.append(f"{name}: {before[name]!r} -> {after[name]!r}")
    return lines


@pytest.fixture(autouse=True)
def leaves_no_state() -> Iterator[None]:
    before = process_state()
    yield
    lines = leaked(before, process_state())
    if lines:
        pytest.fail("the test left state behind in pytest's process:\n" + "\n".join(lines), pytrace=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--one-per-file",
        action="store_true",
        help="of each 2-rank test file (tests/distributed, tests/fuzz/test_fuzz.py), run only its first test",
    )


TWO_RANK_FILES = ("distributed", "fuzz/test_fuzz.py")


@pytest.hookimpl(trylast=True)  # after `-m` deselected its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--one-per-file"):
        return
    tests = Path(__file__).parent
    seen: set[Path] = set()
    kept, dropped = [], []
    for item in items:
        path = item.path
        two_rank = any(path.is_relative_to(tests / part) for part in TWO_RANK_FILES)
        if two_rank and path in seen:
            dropped.append(item)
            continue
        seen.add(path)
        kept.append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
