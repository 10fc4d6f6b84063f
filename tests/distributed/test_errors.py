"""Bad input fails in a real 2-rank fit with a message that names the engine, the setting and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks

EXPECTED = {
    "no_optimizer": r"configure_optimizers` returned None, so no engine would train.*one optimizer per submodule",
    "spanning_optimizer": r"Optimizer 0 holds parameters of .generator. and .discriminator.*one optimizer per",
    "unknown_engine_key": r"entry for 'critic'.*no submodule of that name",
    "optimizer_in_both": r"engine .discriminator. gets an optimizer from `configure_optimizers` and its DeepSpeed",
    "fp16_on_cpu": r"engine 'generator' enables fp16, which DeepSpeed does not run on a CPU.*bf16-mixed",
    "clip_on_frozen": r"engine 'discriminator' has no optimizer.*`gradient_clipping` setting would do nothing",
    "returned_loss_in_manual": r"returned a loss but called no `self.manual_backward`.*'generator', 'discriminator'",
    "detached_loss": r"reaches no trainable engine",
    "scheduler_stepped_by_user": r"scheduler of engine 'generator' is stepped by its optimizer",
}


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, str]]:
    outputs = run_ranks(Path(__file__).with_name("run_errors.py"), timeout=300)
    parsed = {}
    for rank, out in enumerate(outputs):
        parsed[rank] = dict(re.findall(r"^RESULT (\w+): (.*)$", out, flags=re.M))
    return parsed


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_scenario_raises_a_clear_error_on_every_rank(results: dict[int, dict[str, str]], scenario: str) -> None:
    for rank, messages in results.items():
        assert scenario in messages, f"rank {rank} did not run {scenario}"
        assert re.search(EXPECTED[scenario], messages[scenario]), f"rank {rank}: {messages[scenario]}"
