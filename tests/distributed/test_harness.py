"""The harness itself: a function runs on every rank, and a failing rank fails the test with its output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed.harness import on_ranks, rank_command


def rank_and_argument(argument: int) -> tuple[str, int]:
    return os.environ["TEST_RANK"], argument * 2


def fails_on_rank_one() -> None:
    if os.environ["TEST_RANK"] == "1":
        raise RuntimeError("rank one's own error")


def test_each_rank_returns_its_result_in_rank_order() -> None:
    assert on_ranks(rank_and_argument, 21, timeout=120) == [("0", 42), ("1", 42)]


def test_a_failing_rank_fails_with_its_output() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 of _on_rank.py exited with 1:(.|\n)*rank one's own error"):
        on_ranks(fails_on_rank_one, timeout=120)


def test_a_local_function_is_refused() -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="^on_ranks runs module-level functions"):
        on_ranks(local)
    with pytest.raises(ValueError, match="^rank_command runs module-level functions"):  # called directly
        rank_command(Path(), local)
