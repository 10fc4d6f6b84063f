"""What the default training step adds to DeepSpeed's and Lightning's: no collective, no read of a tensor's value,
no walk of the modules.

On 2 CPU ranks, the GAN pattern (D twice, then G through D) and distillation (a frozen ZeRO-3 teacher, a student
stepped after 2 backwards) are fitted at ZeRO 0-3. From the second step on, every call of a ``torch.distributed``
collective is put down to the first frame outside torch and DeepSpeed's ``comm`` that led to it, and every read of
a tensor's values on the host (``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()``, ``.numpy()``,
``nonzero``, ``torch.equal``) to its caller; those in this package are the strategy's own
(the function that made each is counted), and so is every module visited by a walk that this package starts
(``named_modules``, behind ``parameters()`` and ``named_buffers()``), and every copy of an engine's weights into its
master copy (``take_weight_edits``, which runs only after a path that can edit them). With
``find_unused_parameters=True`` the ranks agree after each backward, which the same count shows.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch

import lightning_multids
from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._compat import deepspeed as ds_compat
from tests.distributed.common import cpu_trainer
from tests.distributed.harness import on_ranks
from tests.distributed.test_frozen import FrozenModule
from tests.distributed.test_patterns import PatternModule

PACKAGE = str(Path(lightning_multids.__file__).parent)
PASSED_THROUGH = (str(Path(torch.__file__).parent), str(Path(deepspeed.__file__).parent / "comm"))
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "all_to_all_single",
)
READS = ("item", "tolist", "__bool__", "cpu", "numpy", "nonzero", "equal")
"""Host reads of a tensor's values, as its methods."""
TORCH_READS = ("equal", "nonzero")
"""Host reads of tensors' values, as torch's functions."""
STEPS = 3


def _own(frame: Any) -> str | None:
    """The function of the first frame outside torch (and DeepSpeed's comm wrappers), where it is this package's."""
    while frame is not None and frame.f_code.co_filename.startswith(PASSED_THROUGH):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None and frame.f_code.co_filename.startswith(PACKAGE) else None


class Count(pl.Callback):
    """Counts the strategy's own collectives and value reads in every training step after the first."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._undo: list[Callable[[], None]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx >= 1:
            self._undo = [_counting(torch.distributed, name, self.counts) for name in COLLECTIVES]
            self._undo += [_counting(torch.Tensor, name, self.counts) for name in READS]
            self._undo += [_counting(torch, name, self.counts) for name in TORCH_READS]
            self._undo.append(_counting(torch.nn.Module, "named_modules", self.counts))  # every walk of the modules
            self._undo.append(_counting(ds_compat, "take_weight_edits", self.counts))  # a copy of the partitions

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for undo in self._undo:
            undo()
        self._undo = []


def _counting(owner: Any, name: str, counts: Counter[str]) -> Callable[[], None]:
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        caller = _own(sys._getframe(1))
        if caller is not None:
            counts[f"{name} in {caller}"] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    return lambda: setattr(owner, name, original)


def count_steps(stage: int, find_unused: bool, precision: str = "32-true") -> dict[str, dict[str, int]]:
    """On each rank: the strategy's own collectives and reads over steps 2-3 of each pattern, by name."""
    result = {}
    for pattern in ("gan", "distill"):
        counter = Count()
        if pattern == "gan":
            module: pl.LightningModule = PatternModule("gan", "adam", STEPS)
            configs = None
        else:
            module = FrozenModule("distill", STEPS)
            configs = {"frozen": {"zero_optimization": {"stage": 3}}}
        strategy = MultiDeepSpeedStrategy(stage=stage, engine_configs=configs, find_unused_parameters=find_unused)
        trainer = cpu_trainer(
            strategy,
            callbacks=[counter],
            precision=precision,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        result[pattern] = dict(counter.counts)
    return result


def test_the_default_step_runs_no_collective_and_reads_no_tensor_of_its_own() -> None:
    """At every stage, ZeRO-0 in fp32 included (its non-finite check runs only under anomaly mode, as DDP checks
    nothing).

    The modules have no buffers, so no step looks for them (as DDP, which syncs none in a fit if it had none when
    it wrapped the module)."""
    for stage, precision in [(0, "32-true"), (1, "32-true"), (2, "32-true"), (3, "32-true"), (0, "bf16-mixed")]:
        counts = on_ranks(count_steps, stage, False, precision, timeout=240)  # bf16 at ZeRO-0: FP16_UnfusedOptimizer
        assert counts == [{"gan": {}, "distill": {}}] * 2, f"ZeRO-{stage} {precision}: {counts}"


def test_find_unused_parameters_agrees_after_each_backward() -> None:
    """The count can see the strategy's own: the agreement is one all-reduce and one read per backward."""
    counts = on_ranks(count_steps, 2, True, timeout=240)[0]
    per_step = {"gan": 2, "distill": 2}  # D's backward and G's; two micro-batch backwards
    for pattern, backwards in per_step.items():
        agreed = backwards * (STEPS - 1)
        assert counts[pattern] == {"all_reduce in agree": agreed, "tolist in agree": agreed}, counts
