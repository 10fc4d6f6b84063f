"""Per-rank script: what a frozen ZeRO-3 teacher holds on this rank.

Usage: run_memory.py OUT build | run_memory.py OUT gathered [JSON] | run_memory.py OUT moved

``build``: a large teacher is built in configure_model; this rank's peak memory growth while it is built.
``gathered``: a teacher of 4 layers runs twice per step for 3 steps; which of its parameters are gathered whole
on this rank at the start of each layer's forward, and after each of its forwards. ``JSON`` is the teacher's
``zero_optimization`` entry beyond the stage. The ZeRO-2 student's reduce bucket size is reported too.
``moved``: bf16 fits with a ZeRO-2 and a ZeRO-3 frozen teacher built whole in ``__init__``; the dtype of the
teacher's parameters each time a module holding it is moved to a device during setup, and on a GPU the peak
memory setup adds.
"""

from __future__ import annotations

import json
import sys
import threading
import warnings

import lightning.pytorch as pl
import psutil
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish

warnings.filterwarnings("ignore")
WIDTH, LAYERS = 1024, 16  # about 16.8M parameters, 67 MB in fp32


class PeakRSS:
    """Sample this process's resident memory every millisecond while active; keep the peak."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRSS:
        self.start = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


class BigTeacher(pl.LightningModule):
    def configure_model(self) -> None:
        with PeakRSS() as memory:
            self.teacher = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
            self.student = nn.Linear(WIDTH, WIDTH)
        self.growth = memory.peak - memory.start

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch[:, :1].expand(-1, WIDTH).contiguous()
        return (self.student(x) - self.teacher(x)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(1), batch_size=4)


def gathered(module: nn.Module) -> list[str]:
    """The names of ``module``'s ZeRO-3 parameters that are whole on this rank now."""
    return [name for name, p in module.named_parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]


class TwiceTeacher(pl.LightningModule):
    """A teacher of 4 layers of 64 x 64 called on two micro-batches per step, and a student."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.seen: dict[str, list[list[str]]] = {"in_layer": [], "after_forward": []}

    def configure_model(self) -> None:
        self.teacher = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.student = nn.Linear(64, 64)

    def on_train_start(self) -> None:  # after the engines: these hooks run after ZeRO-3's own gather
        self.student_bucket = self.trainer.strategy.engines["student"].zero_reduce_bucket_size()
        for index, layer in enumerate(self.teacher):
            layer.register_forward_pre_hook(lambda m, args, i=index: self._record_layer(i))

    def _record_layer(self, index: int) -> None:
        own = {f"{index}.weight", f"{index}.bias"}
        self.seen["in_layer"].append([name for name in gathered(self.teacher) if name not in own])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        x = batch[:, :1].expand(-1, 64).contiguous()
        for half in (x[:2], x[2:]):
            with torch.no_grad():
                target = self.teacher(half)
            self.seen["after_forward"].append(gathered(self.teacher))
            self.manual_backward((self.student(half) - target).pow(2).mean())
        self.optimizers().step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(3), batch_size=4)


class MovedTeacher(pl.LightningModule):
    """A teacher (12.7 M parameters, 48 MiB in fp32) and a small student built whole in ``__init__``, in fp32.

    Records the teacher's dtype each time setup moves a module holding it to a device, and on a GPU the peak
    memory that setup adds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(3)], nn.Linear(2048, 64))
        self.student = nn.Linear(2048, 64)
        self.teacher_bytes = sum(p.numel() for p in self.teacher.parameters()) * 4
        self.moves: list[str] = []
        self.setup_peak: int | None = None

    def setup(self, stage: str) -> None:  # Lightning calls it before the strategy's setup; on_fit_start after
        original = nn.Module.to

        def to(module: nn.Module, *args: object, **kwargs: object) -> nn.Module:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None and any(m is self.teacher for m in module.modules()):
                self.moves.append(str(next(self.teacher.parameters()).dtype))
            return original(module, *args, **kwargs)

        nn.Module.to = to  # type: ignore[method-assign]
        self._restore = lambda: setattr(nn.Module, "to", original)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._allocated = torch.cuda.memory_allocated()

    def on_fit_start(self) -> None:
        self._restore()
        if torch.cuda.is_available():
            self.setup_peak = torch.cuda.max_memory_allocated() - self._allocated

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch[:, :1].expand(-1, 2048).contiguous()
        with torch.no_grad():
            target = self.teacher(x)
        return (self.student(x) - target).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(1), batch_size=4)


def main() -> None:
    out, mode, *extra = sys.argv[1:]
    if mode == "gathered":
        main_gathered(out, json.loads(extra[0]) if extra else {})
        return
    if mode == "moved":
        main_moved(out)
        return
    module = BigTeacher()
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": {"zero_optimization": {"stage": 3}}})
    trainer = cpu_trainer(strategy, max_steps=1, enable_checkpointing=False)
    trainer.fit(module)
    teacher_bytes = sum(p.ds_numel for p in module.teacher.parameters()) * 4
    local_bytes = sum(p.ds_tensor.numel() for p in module.teacher.parameters()) * 4
    result = {"growth": module.growth, "teacher_bytes": teacher_bytes, "local_bytes": local_bytes}
    torch.save(result, f"{out}.{trainer.global_rank}")


def main_gathered(out: str, zero: dict) -> None:
    module = TwiceTeacher()
    # Every parameter below DeepSpeed's persistence threshold (1e5 elements) would stay whole for good; with 0
    # each takes part in gathering and releasing.
    teacher = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": teacher})
    trainer = cpu_trainer(strategy, enable_checkpointing=False)
    trainer.fit(module)
    module.seen["student_bucket"] = module.student_bucket
    torch.save(module.seen, f"{out}.{trainer.global_rank}")


def main_moved(out: str) -> None:
    moves = {}
    for stage in (2, 3):
        module = MovedTeacher()
        strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": {"zero_optimization": {"stage": stage}}})
        trainer = cpu_trainer(strategy, precision="bf16-mixed", max_steps=1, enable_checkpointing=False)
        trainer.fit(module)
        moves[stage] = {"moves": module.moves, "setup_peak": module.setup_peak}
    moves["teacher_fp32_bytes"] = module.teacher_bytes
    torch.save(moves, f"{out}.{trainer.global_rank}")


if __name__ == "__main__":
    main()
    finish()
