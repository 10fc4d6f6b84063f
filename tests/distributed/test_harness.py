"""The harness itself: a function runs on every rank, a failing or hung rank fails the test with its output, and
one launch's ranks see nothing of another's."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch

import lightning_multids
from tests.conftest import leaked, process_state
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


def leave_state_behind() -> None:
    """Change what a later test's ranks would see, were they this process's children or this process."""
    os.environ["TEST_LEFT_BEHIND"] = "1"
    torch.set_default_dtype(torch.float64)
    lightning_multids.LEFT_BEHIND = True  # type: ignore[attr-defined]
    torch.distributed.init_process_group("gloo", rank=int(os.environ["TEST_RANK"]), world_size=2)


def state_seen() -> dict[str, object]:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return {
        "variable": os.environ.get("TEST_LEFT_BEHIND"),
        "default dtype": torch.get_default_dtype(),
        "attribute": hasattr(lightning_multids, "LEFT_BEHIND"),
        "process group": torch.distributed.is_initialized(),
        "rank_zero_only": rank_zero_only.rank,
        "draws": (random.random(), torch.rand(1).item()),
    }


def test_a_launch_sees_nothing_of_the_launch_before() -> None:
    """Ranks are forked anew for every launch: what one launch's ranks change, the next launch's never see."""
    on_ranks(leave_state_behind, timeout=120)
    first, second = on_ranks(state_seen, timeout=120)
    clean = {"variable": None, "default dtype": torch.float32, "attribute": False, "process group": False}
    assert {key: first[key] for key in clean} == clean == {key: second[key] for key in clean}
    assert (first["rank_zero_only"], second["rank_zero_only"]) == (0, 1)  # Lightning's rank, read in the rank
    again = on_ranks(state_seen, timeout=120)[0]
    for kind in (0, 1):  # Python's and torch's draws: fresh seeds in every rank, as in a new interpreter
        assert len({first["draws"][kind], second["draws"][kind], again["draws"][kind]}) == 3


def sleeps_on_rank_one() -> None:
    if os.environ["TEST_RANK"] == "1":
        print("rank 1 sleeps now", flush=True)
        time.sleep(600)


def test_a_hung_rank_fails_within_its_timeout_and_the_next_launch_runs() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"a rank did not finish within 5 s(.|\n)*rank 1.*\nrank 1 sleeps now"):
        on_ranks(sleeps_on_rank_one, timeout=5)  # with each rank's last lines
    assert time.monotonic() - start < 30
    assert on_ranks(rank_and_argument, 1, timeout=120) == [("0", 2), ("1", 2)]


def port_taken_once(marks: str, error: str) -> str:
    """Fails with ``error`` on rank 0 of the first launch (rank 1 hangs), passes on the next; the launch's port.

    Rank 0 marks each launch with a file named by its port in ``marks``; a launch is the first while no other
    launch's mark is there.
    """
    launches, port = Path(marks), os.environ["MASTER_PORT"]
    if os.environ["TEST_RANK"] == "0":
        (launches / port).touch()
    if not [path for path in launches.iterdir() if path.name != port]:
        if os.environ["TEST_RANK"] == "1":
            time.sleep(600)  # as a rank waiting to connect to the port rank 0 could not bind
        raise RuntimeError(error)
    return port


def test_a_launch_whose_port_was_taken_runs_once_more_and_no_other_failure_does(tmp_path: Path) -> None:
    taken = "The server socket has failed to listen on any local network address. name: EADDRINUSE"
    (tmp_path / "taken").mkdir()
    start = time.monotonic()
    ports = on_ranks(port_taken_once, str(tmp_path / "taken"), taken, timeout=120)
    assert time.monotonic() - start < 60, "rank 1 of the first launch was not stopped when rank 0 failed"
    assert ports[0] == ports[1] and len(list((tmp_path / "taken").iterdir())) == 2  # on another port
    (tmp_path / "other").mkdir()
    with pytest.raises(AssertionError, match="an error of the test's own"):
        on_ranks(port_taken_once, str(tmp_path / "other"), "an error of the test's own", timeout=120)
    assert len(list((tmp_path / "other").iterdir())) == 1


def parent() -> int:
    return os.getppid()


def test_fresh_ranks_are_new_interpreters() -> None:
    """``fresh=True`` (what is read at process start, e.g. glibc's ``MALLOC_*``): the ranks are this process's
    children, started anew, not forked from the fork server."""
    assert on_ranks(parent, fresh=True, timeout=120) == [os.getpid()] * 2
    forked = on_ranks(parent, timeout=120)
    assert forked[0] == forked[1] != os.getpid()


def test_state_left_in_pytests_own_process_is_named() -> None:
    """The autouse check of ``tests/conftest.py``: what a test leaves behind in this process, one line each."""
    before = process_state()
    os.environ["TEST_LEFT_BEHIND"] = "1"
    torch.set_default_dtype(torch.float64)
    try:
        after = process_state()
    finally:
        del os.environ["TEST_LEFT_BEHIND"]
        torch.set_default_dtype(torch.float32)
    assert leaked(before, after) == [
        "environment variable TEST_LEFT_BEHIND: None -> '1'",
        "default dtype: torch.float32 -> torch.float64",
    ]
    assert leaked(before, process_state()) == []
