"""Schedulers in manual optimization step when the user steps them, exactly as under Lightning's DDPStrategy.

The snippets of Lightning's manual-optimization guide: a scheduler stepped every step, every N epochs, a
ReduceLROnPlateau stepped with a logged metric, and a scheduler that is not a torch one. Each runs under
``DDPStrategy`` and under MultiDeepSpeedStrategy at ZeRO 0-3 on the same 2 ranks and data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_schedulers as case
from tests.distributed.harness import run_ranks

TOLERANCE = 1e-5
STAGES = ("zero0", "zero1", "zero2", "zero3")
EXPECTED_LR = {  # lr 0.2; 3 epochs of 4 steps
    "every_step": 0.2 * 0.8**12,
    "every_n_epochs": 0.2 * 0.5,  # after epoch 2 of 3
    "plateau": 0.2 * 0.5**2,  # epochs 2 and 3 do not improve on epoch 1 by 10
    "custom": 0.2 * 0.5**12,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("schedulers") / "results.pt"
    run_ranks(Path(case.__file__), str(out), timeout=600)
    return torch.load(out)


@pytest.mark.parametrize("mode", case.MODES)
def test_ddp_steps_the_schedulers_as_the_guide_says(results: dict, mode: str) -> None:
    """The baseline itself: the learning rates DDP ends with are the ones the snippet asks for."""
    assert results[("ddp", mode)]["lr"] == [pytest.approx(EXPECTED_LR[mode])] * 2


@pytest.mark.parametrize("mode", case.MODES)
@pytest.mark.parametrize("stage", STAGES)
def test_schedulers_step_as_under_ddp(results: dict, stage: str, mode: str) -> None:
    ours, ddp = results[(stage, mode)], results[("ddp", mode)]
    assert ours["own_schedulers"], "self.lr_schedulers() must return the objects from configure_optimizers"
    assert ours["lr"] == pytest.approx(ddp["lr"])
    assert ours["weights"].keys() == ddp["weights"].keys()
    for key, expected in ddp["weights"].items():
        diff = (ours["weights"][key] - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{stage}, {mode}: {key} differs from DDP by {diff:.2e}"
