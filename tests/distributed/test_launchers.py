"""Every launcher docs/multi-node.md names gives the weights ``DDPStrategy`` gives under the same launch.

Each launch starts 2 CPU processes with exactly the variables that launcher sets (as Lightning's own tests of its
cluster environments do): ``srun`` (Lightning's ``SLURMEnvironment``: ``SLURM_*`` and ``MASTER_ADDR``/``MASTER_PORT``,
no ``LOCAL_RANK``, ``RANK`` or ``WORLD_SIZE``), ``torchrun`` (``TorchElasticEnvironment``), IBM's ``jsrun``
(``LSFEnvironment``: ``JSM_NAMESPACE_*`` and a rank file) and Kubeflow's PyTorchJob (``KubeflowEnvironment``:
``RANK``/``WORLD_SIZE``, one process a node). Lightning's own launcher and a launch by hand
(``MASTER_ADDR``/``NODE_RANK``, Lightning starting the node's processes) hand every process the variables the
harness sets by default, which the rest of the suite runs under. In each launch, the same processes fit a GAN
(two SGD optimizers) under ``DDPStrategy`` and then under the strategy at each ZeRO stage asked for, and every
weight must equal DDP's. ``DDPStrategy`` trains under each of them; before the strategy set DeepSpeed's variables
from Lightning's cluster environment, every one without ``LOCAL_RANK`` stopped in ``deepspeed.initialize``.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import KubeflowEnvironment
from lightning.pytorch.strategies import DDPStrategy

import lightning_multids
from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import RankEnv, on_ranks

STEPS = 3
PACKAGE = str(Path(lightning_multids.__file__).parent)
UNSET_LAUNCH = {"LOCAL_RANK": None, "RANK": None, "WORLD_SIZE": None, "NODE_RANK": None}
"""The harness's own launch variables, which these launchers do not set (each sets its own)."""


class Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(STEPS))


def _weights(strategy: pl.strategies.Strategy) -> dict[str, torch.Tensor]:
    if isinstance(strategy, MultiDeepSpeedStrategy):
        return strategy.consolidated_state_dict()
    assert strategy.lightning_module is not None
    return {key: value.detach().clone() for key, value in strategy.lightning_module.state_dict().items()}


def fit_under_launcher(stages: list[int], nodes: int, kubeflow: bool) -> dict[str, tuple[dict[str, Any], int]]:
    """On each rank: fit :class:`Gan` under ``DDPStrategy``, then under the strategy at each of ``stages``.

    Each fit's weights, and how many process groups the package made in it (DeepSpeed's own not counted).
    """
    strategies: dict[str, pl.strategies.Strategy] = {
        "ddp": DDPStrategy(process_group_backend="gloo", find_unused_parameters=True),  # one backward per model
        **{f"zero{stage}": MultiDeepSpeedStrategy(stage=stage) for stage in stages},
    }
    results = {}
    for name, strategy in strategies.items():
        at_end = AtFitEnd(_weights)
        trainer = cpu_trainer(  # 2 nodes of 1 process where the harness launched 2 nodes (TEST_NUM_NODES)
            strategy,
            callbacks=[at_end],
            plugins=[KubeflowEnvironment()] if kubeflow else [],
            use_distributed_sampler=False,
            enable_checkpointing=False,
        )
        made = _groups_made_by(PACKAGE)
        try:
            trainer.fit(Gan())
        finally:
            torch.distributed.new_group = made.original  # type: ignore[assignment]
        results[name] = (at_end.value, made.count)
    return results


class _Counted:
    def __init__(self, original: Any) -> None:
        self.original, self.count = original, 0


def _groups_made_by(folder: str) -> _Counted:
    """Count the calls of ``torch.distributed.new_group`` made by code in ``folder`` until the original is put back."""
    made = _Counted(torch.distributed.new_group)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        made.count += sys._getframe(1).f_code.co_filename.startswith(folder)
        return made.original(*args, **kwargs)

    torch.distributed.new_group = new_group  # type: ignore[assignment]
    return made


def slurm(rank: int) -> dict[str, str | None]:
    """What ``srun --ntasks-per-node=2`` sets on one node (``MASTER_ADDR``/``MASTER_PORT`` from the job script)."""
    return {
        **UNSET_LAUNCH,
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4321",
        "SLURM_JOB_NAME": "train.py",
        "SLURM_NODELIST": "127.0.0.1",
    }


def torchrun(rank: int) -> dict[str, str | None]:
    """What ``torchrun --nproc-per-node 2`` sets."""
    return {
        **UNSET_LAUNCH,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "launch-test",
    }


def lsf(rank_file: Path) -> RankEnv:
    """What ``jsrun`` sets on one host, with its rank file (the launch node, then this host per task)."""
    host = socket.gethostname()
    rank_file.write_text(f"launch\n{host}\n{host}\n")

    def variables(rank: int) -> dict[str, str | None]:
        return {
            **UNSET_LAUNCH,
            "LSB_JOBID": "4321",
            "LSB_DJOB_RANKFILE": str(rank_file),
            "JSM_NAMESPACE_SIZE": "2",
            "JSM_NAMESPACE_RANK": str(rank),
            "JSM_NAMESPACE_LOCAL_RANK": str(rank),
        }

    return variables


def kubeflow(rank: int) -> dict[str, str | None]:
    """What a Kubeflow PyTorchJob of 2 replicas sets (one process a pod, a node each)."""
    return {**UNSET_LAUNCH, "RANK": str(rank), "WORLD_SIZE": "2", "KUBERNETES_PORT": "tcp://127.0.0.1:443"}


LAUNCHES = {  # launcher: ZeRO stages fitted after DDP (srun, the reported case, at each stage; the rest at one)
    "srun": [0, 2, 3],
    "torchrun": [3],
    "jsrun": [2],
    "kubeflow": [3],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHES))
def test_each_launcher_gives_ddps_weights(launcher: str, tmp_path: Path) -> None:
    variables = {"srun": slurm, "torchrun": torchrun, "jsrun": lsf(tmp_path / "rankfile"), "kubeflow": kubeflow}
    nodes = 2 if launcher == "kubeflow" else 1
    results = on_ranks(
        fit_under_launcher, LAUNCHES[launcher], nodes, launcher == "kubeflow", rank_env=variables[launcher]
    )[0]
    expected, _ = results.pop("ddp")
    initial = patterns.weights(*patterns.make_modules())
    assert max((expected[key] - value).abs().max().item() for key, value in initial.items()) > 1e-3, "nothing trained"
    for name, (weights, groups) in results.items():
        assert groups == 0, f"{launcher} {name}: a fit that enters no `gathered` block made {groups} group(s)"
        assert weights.keys() == expected.keys(), name
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6, msg=f"{launcher} {name} {key}")
