"""One ``train_dataloader()`` call per fit, and the engines' batch size from the real per-process batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_data
from tests.distributed.harness import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("data") / "results.pt"
    run_ranks(Path(run_data.__file__), str(out), timeout=300)
    return torch.load(out)


@pytest.mark.parametrize("case", ["single", "combined"])
def test_train_dataloader_runs_once_per_fit(results: dict, case: str) -> None:
    assert results[case]["calls"] == 1


@pytest.mark.parametrize("case", ["single", "combined"])
def test_engines_get_the_per_process_batch_size(results: dict, case: str) -> None:
    """4 per process: the DataLoader's own, or the first of several (as Lightning's batch-size inference)."""
    assert results[case]["micro"] == {"generator": 4, "discriminator": 4}


def test_lightning_still_shards_the_loader_it_got_at_setup(results: dict) -> None:
    """The loader requested at setup still gets Lightning's DistributedSampler: 32 samples, 4 per batch, 2 ranks."""
    assert results["single"]["batches"] == run_data.SAMPLES // (4 * 2)
