"""What the strategy sets around DeepSpeed: the launch variables DeepSpeed reads, and where its JIT builds go.

(The warnings hidden while its engines live: ``test_noise.py``.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lightning_multids._environment import (
    EXTENSIONS_VARIABLE,
    keep_extensions_in_environment,
    set_launch_variables,
)

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
