"""No hang when a rank fails; the same weights from 2 nodes x 1 process as from 1 node x 2 processes.

The rank code of the failures: :func:`fit_failing` fits :class:`Failing`, where rank 1 raises, in training_step
(MODE ``step``) or during setup (MODE ``setup``); or, at ZeRO-3, only rank R enters ``strategy.gathered`` in
training_step (MODE ``gatheredR``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer
from tests.distributed.harness import REPO, free_port, on_ranks, rank_command
from tests.distributed.test_patterns import fit_patterns


class Failing(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.mode == "step" and batch_idx == 1 and self.global_rank == 1:
            raise RuntimeError("rank 1 failed on purpose in training_step")
        if self.mode == f"gathered{self.global_rank}" and batch_idx == 1:
            with self.trainer.strategy.gathered("discriminator") as discriminator:  # type: ignore[attr-defined]
                discriminator(torch.zeros(1, 6))
        if self.mode == "edited" and batch_idx == 1 and self.global_rank == 0:  # ZeRO-2: only its edit's broadcast
            with self.trainer.strategy.gathered("discriminator", modifier_rank=0):  # type: ignore[attr-defined]
                pass
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        if self.mode == "setup" and self.global_rank == 1:
            raise RuntimeError("rank 1 failed on purpose during setup")
        return [patterns.make_optimizer("sgd", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(4), batch_size=4)


def fit_failing(mode: str) -> None:
    """On each rank: fit :class:`Failing` with ``mode``, at ZeRO-2 (ZeRO-3 for the ``gathered`` modes)."""
    if mode.startswith("gathered"):
        strategy = MultiDeepSpeedStrategy(stage=3, gathered_timeout=timedelta(seconds=2))
    elif mode == "edited":
        strategy = MultiDeepSpeedStrategy(stage=2, gathered_timeout=timedelta(seconds=2))
    else:
        strategy = MultiDeepSpeedStrategy(stage=2)
    cpu_trainer(strategy, enable_checkpointing=False).fit(Failing(mode))


FAILURES = {  # mode: (the rank that fails, what it says)
    "step": (1, "[rank 1] MultiDeepSpeedStrategy: RuntimeError: rank 1 failed on purpose"),
    "setup": (1, "[rank 1] MultiDeepSpeedStrategy: RuntimeError: rank 1 failed on purpose"),
    **{  # a ZeRO-3 `gathered` block entered by one rank only
        f"gathered{rank}": (
            rank,
            f"[rank {rank}] MultiDeepSpeedStrategy: RuntimeError: `strategy.gathered('discriminator')` did not meet "
            "every rank within 0:00:02",
        )
        for rank in (0, 1)
    },
    "edited": (  # at ZeRO-2 too: the edit's broadcasts are collectives
        0,
        "[rank 0] MultiDeepSpeedStrategy: RuntimeError: `strategy.gathered('discriminator')` did not meet every rank "
        "within 0:00:02",
    ),
}


@pytest.mark.parametrize("mode", sorted(FAILURES))
def test_a_failing_rank_stops_every_rank_within_60_seconds(tmp_path: Path, mode: str) -> None:
    """The clock starts when the first process exits (start-up takes as long as it takes)."""
    port, procs, logs = str(free_port()), [], [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    command = [sys.executable, *rank_command(tmp_path, fit_failing, mode)]
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", NODE_RANK="0")
        env.update(LOCAL_RANK=str(rank), TEST_RANK=str(rank), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        with logs[rank].open("w") as log:  # a file, not a pipe: a full pipe would block the process
            procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=log))
    try:
        first_exit = wait_until(lambda: any(p.poll() is not None for p in procs), timeout=300)
        assert first_exit, "no rank stopped within 300 s of start"
        all_exited = wait_until(lambda: all(p.poll() is not None for p in procs), timeout=60)
        assert all_exited, "a rank was still running 60 s after another stopped: a hang"
    finally:
        for proc in procs:
            proc.kill()
    outputs = [log.read_text() for log in logs]
    assert all(proc.returncode != 0 for proc in procs), [proc.returncode for proc in procs]
    rank, message = FAILURES[mode]
    assert message in outputs[rank], outputs[rank][-3000:]


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_two_nodes_of_one_process_match_one_node_of_two() -> None:
    names = ("gan_toggle", "accumulate")
    results = {nodes: on_ranks(fit_patterns, 2, "sgd", 4, "32-true", list(names), nodes=nodes)[0] for nodes in (1, 2)}
    for name in names:
        expected = patterns.reference(name, "sgd", 4)
        for key, value in results[2][name]["weights"].items():
            torch.testing.assert_close(value, results[1][name]["weights"][key], rtol=0, atol=1e-6)
            torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-5)
