"""Lightning's setup conventions, as DDPStrategy follows them: ``sync_batchnorm`` and module states outside fit."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests import patterns
from tests.distributed import run_conventions as case
from tests.distributed.harness import run_ranks


def run(out: Path, name: str) -> list[dict]:
    run_ranks(Path(case.__file__), str(out), name, timeout=300)
    return [torch.load(f"{out}.rank{rank}") for rank in range(2)]


def test_sync_batchnorm_converts_for_fit_and_reverts_after(tmp_path: Path) -> None:
    """As under DDP: BatchNorm layers are SyncBatchNorm during fit, and a plain BatchNorm again after teardown."""
    for seen in run(tmp_path / "out.pt", "sync_batchnorm"):
        assert seen["during_fit"] == "SyncBatchNorm"
        assert seen["after_fit"] != "SyncBatchNorm" and seen["batchnorm_after_fit"]  # Lightning's _BatchNormXd


def test_validate_starts_every_rank_from_rank_zero_weights(tmp_path: Path) -> None:
    """Outside fit rank 0's weights reach every rank, as DDP syncs module states; ZeRO-3 partitions stay per rank."""
    rank0, rank1 = run(tmp_path / "out.pt", "validate")
    assert not torch.equal(rank0["plain_before"]["weight"], rank1["plain_before"]["weight"])
    for key, value in rank0["plain_before"].items():
        assert torch.equal(rank0["plain_after"][key], value)
        assert torch.equal(rank1["plain_after"][key], value)
    torch.manual_seed(0)
    teacher = nn.Linear(6, 4)
    for seen in (rank0, rank1):
        for key, value in teacher.state_dict().items():
            torch.testing.assert_close(seen["teacher"][key], value)
    real, _ = patterns.split(patterns.make_batches(2))
    expected = teacher(real).detach()
    got = torch.stack([rank0["outputs"], rank1["outputs"]], dim=1).reshape(-1, 4)  # rank r holds rows r, r + 2, ...
    torch.testing.assert_close(got, expected)
