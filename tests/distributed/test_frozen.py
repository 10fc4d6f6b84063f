"""Frozen (inference) engines, mixed ZeRO stages and DeepSpeed-config optimizers, against plain PyTorch.

The rank code of the fits, :func:`fit_specs`, fits each SPEC ``case:frozen_stage:trained_stage`` (a frozen stage
``3o``: ZeRO-3 with ``offload_param`` to the CPU) with case ``distill`` (frozen teacher, trained student),
``frozen_middle`` (loss = frozen critic(generator(z))), ``frozen_twice`` (the same and frozen critic(real) in one
loss), ``config_optimizer`` (the student's optimizer comes from its DeepSpeed config) or ``configure_model`` (the
distillation's submodules built in ``configure_model``), and returns what each ended with. The GPU suite runs it
too, on one GPU. The memory tests' rank code follows it: :func:`build_big_teacher` (the peak memory of building
a large ZeRO-3 teacher), :func:`watch_gathered` (which of a frozen ZeRO-3 teacher's parameters are whole during
and after its forwards) and :func:`move_teachers` (the teacher's dtype each time setup moves it to a device, the
GPU suite's too).
"""

from __future__ import annotations

import threading
from typing import Any

import lightning.pytorch as pl
import psutil
import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from lightning.pytorch.callbacks import ModelSummary
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._config import DEEPSPEED_ZERO3
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

STEPS = 4


SGD_CONFIG = {"optimizer": {"type": "SGD", "params": {"lr": 0.2}}}


class FrozenModule(pl.LightningModule):
    def __init__(self, case: str, steps: int) -> None:
        super().__init__()
        self.case, self.steps = case, steps
        self.automatic_optimization = False  # user-managed accumulation
        if case in patterns.FROZEN_IN_THE_MIDDLE:
            self.trained, _ = patterns.make_modules()
            _, self.frozen = patterns.make_modules()
        elif case != "configure_model":
            self.frozen, self.trained = patterns.make_distill_modules()

    def configure_model(self) -> None:
        """Case ``configure_model``: the submodules are built here, under the strategy's ZeRO-3 init."""
        if self.case == "configure_model" and not hasattr(self, "frozen"):
            self.frozen, self.trained = patterns.make_distill_modules()
            self.built_partitioned = {
                "frozen": all(hasattr(p, "ds_id") for p in self.frozen.parameters()),
                "trained": all(hasattr(p, "ds_id") for p in self.trained.parameters()),
            }

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        if self.case in patterns.FROZEN_IN_THE_MIDDLE:
            patterns.FROZEN_IN_THE_MIDDLE[self.case](self.trained, self.frozen, batch, opt, self.manual_backward)
        else:
            patterns.distill_step(self.frozen, self.trained, batch, opt, self.manual_backward)

    def configure_optimizers(self) -> torch.optim.Optimizer | None:
        if self.case == "config_optimizer":
            return None
        return patterns.make_optimizer("sgd", self.trained.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = patterns.make_batches(self.steps)
        return sharded_loader(self, data)


class ReadSummary(pl.Callback):
    """What the trainer's ModelSummary callback counts at the start of fit, per top-level submodule."""

    def __init__(self, summary: ModelSummary) -> None:
        self.summary = summary
        self.value: dict = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        counted = self.summary._summary(trainer, pl_module)
        layers = dict(zip(counted.layer_names, counted.param_nums, strict=True))
        self.value = {"total": counted.total_parameters, "layers": layers}


def partition_share(module: torch.nn.Module) -> float:
    """The fraction of ``module``'s parameters this rank holds (1.0 when not partitioned)."""
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
    full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    return local / full


def frozen_config(stage: str) -> dict:
    if stage == "3o":
        return {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    return {"zero_optimization": {"stage": int(stage)}}


def fit_specs(steps: int, precision: str, specs: list[str]) -> dict[str, dict[str, Any]]:
    """One rank: fit each spec; what the tests read of each."""
    results = {}
    for spec in specs:
        case, frozen_stage, trained_stage = spec.split(":")
        module = FrozenModule(case, steps)
        trained = {"zero_optimization": {"stage": int(trained_stage)}}
        if case == "config_optimizer":
            trained.update(SGD_CONFIG)
        strategy = MultiDeepSpeedStrategy(engine_configs={"frozen": frozen_config(frozen_stage), "trained": trained})
        engines_at_end = AtFitEnd(
            lambda s: {
                "engines": sorted(s.engines),
                "frozen_has_optimizer_state": bool(getattr(s.engines["frozen"], "basic_optimizer", None)),
                "frozen_offloads_parameters": bool(s.engines["frozen"].zero_offload_param()),
                "dtype": str(next(s.lightning_module.trained.parameters()).dtype),  # fp32 again after teardown
                "in_use": [  # ZeRO-3 parameters a submodule still marks as in use after the last step
                    name
                    for name, p in s.lightning_module.named_parameters()
                    if getattr(p, "ds_active_sub_modules", None)
                ],
            }
        )
        summary = ModelSummary()
        read_summary = ReadSummary(summary)
        trainer = cpu_trainer(
            strategy,
            callbacks=[engines_at_end, summary, read_summary],
            enable_model_summary=True,
            precision=precision,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        state = strategy.consolidated_state_dict()
        results[spec] = {
            "weights": {
                k.replace("trained.", ""): v.float().clone() for k, v in state.items() if k.startswith("trained.")
            },
            "frozen_share": partition_share(module.frozen),
            "frozen_training": module.frozen.training,
            "frozen_requires_grad": any(p.requires_grad for p in module.frozen.parameters()),
            "optimizers": [opt.name for opt in strategy.optimizers],
            **engines_at_end.value,
            "built_partitioned": getattr(module, "built_partitioned", None),
            "trained_partitioned": any(hasattr(p, "ds_id") for p in module.trained.parameters()),
            "case": case,
            "summary": read_summary.value,
            "summary_restored": "_summary" not in vars(summary),
        }
    return results


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


def build_big_teacher() -> dict[str, int]:
    """One rank: this rank's peak memory growth while configure_model builds a large ZeRO-3 teacher."""
    module = BigTeacher()
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": {"zero_optimization": {"stage": 3}}})
    trainer = cpu_trainer(strategy, max_steps=1, enable_checkpointing=False)
    trainer.fit(module)
    teacher_bytes = sum(p.ds_numel for p in module.teacher.parameters()) * 4
    local_bytes = sum(p.ds_tensor.numel() for p in module.teacher.parameters()) * 4
    return {"growth": module.growth, "teacher_bytes": teacher_bytes, "local_bytes": local_bytes}


def watch_gathered(zero: dict[str, Any]) -> dict[str, Any]:
    """One rank: which of a ZeRO-3 teacher's parameters are gathered in each layer's forward and after each forward.

    ``zero`` is the teacher's ``zero_optimization`` entry beyond the stage. The ZeRO-2 student's reduce bucket
    size comes back too.
    """
    module = TwiceTeacher()
    # Every parameter below DeepSpeed's persistence threshold (1e5 elements) would stay whole for good; with 0
    # each takes part in gathering and releasing.
    teacher = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": teacher})
    trainer = cpu_trainer(strategy, enable_checkpointing=False)
    trainer.fit(module)
    return {**module.seen, "student_bucket": module.student_bucket}


def move_teachers() -> dict[Any, Any]:
    """One rank: bf16 fits with a ZeRO-2 and a ZeRO-3 frozen teacher built whole in ``__init__``; per stage, the
    teacher's dtype at each move to a device during setup and (on a GPU) the peak memory setup adds."""
    moves: dict[Any, Any] = {}
    for stage in (2, 3):
        module = MovedTeacher()
        strategy = MultiDeepSpeedStrategy(stage=2, engine_configs={"teacher": {"zero_optimization": {"stage": stage}}})
        trainer = cpu_trainer(strategy, precision="bf16-mixed", max_steps=1, enable_checkpointing=False)
        trainer.fit(module)
        moves[stage] = {"moves": module.moves, "setup_peak": module.setup_peak}
    moves["teacher_fp32_bytes"] = module.teacher_bytes
    return moves


def train(precision: str, *specs: str) -> dict:
    return on_ranks(fit_specs, STEPS, precision, list(specs))[0]


def assert_matches_reference(result: dict, case: str, tolerance: float = 1e-5) -> None:
    reference = patterns.reference_distill(case, STEPS)
    initial = patterns.reference_distill(case, 0)
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    assert moved >= 1e-2, f"the reference barely trained ({moved:.1e})"
    for key, expected in reference.items():
        trained = result["weights"][key.split(".", 1)[1]]
        diff = (trained - expected).abs().max().item()
        assert diff <= tolerance, f"{key}: max abs difference {diff:.2e} from plain PyTorch"


def assert_frozen(result: dict, frozen_stage: int) -> None:
    assert result["engines"] == ["frozen", "trained"]
    assert result["optimizers"] == ["trained"]
    assert result["frozen_training"] is False, "a frozen engine must stay in eval mode during fit"
    assert result["frozen_requires_grad"] is False
    assert result["frozen_has_optimizer_state"] is False
    if frozen_stage == 3:
        assert result["frozen_share"] == pytest.approx(0.5, abs=0.02), "ZeRO-3 must hold about 1/N per rank"
    else:
        assert result["frozen_share"] == 1.0
    assert_summary_counts_whole(result)


def assert_summary_counts_whole(result: dict) -> None:
    """Lightning's model summary counts every submodule's parameters whole, a ZeRO-3 engine's too."""
    if result["case"] in patterns.FROZEN_IN_THE_MIDDLE:
        (trained, _), (_, frozen) = patterns.make_modules(), patterns.make_modules()
    else:
        frozen, trained = patterns.make_distill_modules()
    expected = {"frozen": sum(p.numel() for p in frozen.parameters())}
    expected["trained"] = sum(p.numel() for p in trained.parameters())
    assert result["summary"]["layers"] == expected, result["summary"]
    assert result["summary"]["total"] == sum(expected.values())
    assert result["summary_restored"], "the summary callback must be put back at teardown"


@pytest.mark.parametrize("teacher_stage", [0, 3])
def test_distillation_with_frozen_teacher_matches_pytorch(teacher_stage: int) -> None:
    """Teacher at ZeRO {0, 3} x student at {1, 2, 3}, user-managed accumulation of 2, SGD."""
    specs = [f"distill:{teacher_stage}:{student}" for student in (1, 2, 3)]
    results = train("32-true", *specs)
    for spec in specs:
        assert_matches_reference(results[spec], "distill")
        assert_frozen(results[spec], teacher_stage)


def test_a_teacher_offloaded_to_the_cpu_gives_the_same_student() -> None:
    """``offload_param`` on a frozen ZeRO-3 teacher: its logits, and so the student's weights, are plain PyTorch's."""
    specs = ["distill:3o:1", "distill:3o:2"]
    results = train("32-true", *specs)
    for spec in specs:
        assert results[spec]["frozen_offloads_parameters"] is True
        assert_matches_reference(results[spec], "distill")
        assert_frozen(results[spec], 3)


def test_frozen_engine_in_the_middle_at_every_stage() -> None:
    """loss = frozen_critic(G(z)): gradients pass through the frozen engine into G, both at the same stage."""
    specs = [f"frozen_middle:{stage}:{stage}" for stage in (0, 1, 2, 3)] + ["frozen_middle:3:1"]
    results = train("32-true", *specs)
    for spec in specs:
        assert_matches_reference(results[spec], "frozen_middle")
        assert_frozen(results[spec], int(spec.split(":")[1]))


def test_a_frozen_zero3_engine_called_twice_in_one_loss() -> None:
    """loss = critic(G(z)) + critic(real): the critic's backward runs for its first call only.

    DeepSpeed's count of the gradients a submodule waits for restarts at each call, so the backward did not
    release the critic's parameters: they stayed gathered and marked in use, and the next partition failed.
    """
    specs = ["frozen_twice:3:0", "frozen_twice:3:3"]
    results = train("32-true", *specs)
    for spec in specs:
        assert results[spec]["in_use"] == []
        assert_matches_reference(results[spec], "frozen_twice")
        assert_frozen(results[spec], 3)


def test_optimizer_from_the_deepspeed_config() -> None:
    """configure_optimizers returns None; the student's SGD comes from its DeepSpeed config."""
    results = train("32-true", "config_optimizer:3:2", "config_optimizer:0:0")
    for spec, result in results.items():
        assert_matches_reference(result, "distill")
        assert_frozen(result, int(spec.split(":")[1]))


def test_teacher_built_in_configure_model_is_partitioned_from_the_start() -> None:
    """A ZeRO-3 teacher is built under zero.Init; the ZeRO-2 student beside it ends up whole and trains."""
    result = train("32-true", "configure_model:3:2")["configure_model:3:2"]
    assert result["built_partitioned"] == {"frozen": True, "trained": True}, "zero.Init was not active"
    assert result["trained_partitioned"] is False, "the ZeRO-2 student must be made whole before its engine"
    assert_frozen(result, 3)
    assert_matches_reference(result, "distill")


def test_bf16_distillation_learns() -> None:
    result = train("bf16-mixed", "distill:3:2")["distill:3:2"]
    assert result["dtype"] == "torch.bfloat16"
    assert_frozen(result, 3)
    # bf16 keeps ~3 significant digits: compare with the fp32 reference at that resolution.
    assert_matches_reference(result, "distill", tolerance=3e-2)


def test_zero3_teacher_never_exists_whole_in_one_process() -> None:
    """Each rank's memory grows by about half a 64 MiB teacher while configure_model builds it, not all of it.

    glibc raises its mmap threshold as large blocks are freed and then keeps freed memory in the heap, so
    resident memory would count layers already partitioned and freed; a fixed threshold makes it count
    live memory only. glibc reads the threshold when a process starts: the ranks are new interpreters (``fresh``).
    """
    results = on_ranks(build_big_teacher, env={"MALLOC_MMAP_THRESHOLD_": "131072"}, fresh=True)
    for rank, result in enumerate(results):
        assert result["local_bytes"] == pytest.approx(result["teacher_bytes"] / 2, rel=0.01)
        assert result["growth"] < 0.75 * result["teacher_bytes"], (
            f"rank {rank}: memory grew by {result['growth'] / 2**20:.0f} MiB while building a "
            f"{result['teacher_bytes'] / 2**20:.0f} MiB teacher"
        )


@pytest.mark.parametrize("settings", [{}, DEEPSPEED_ZERO3], ids=["lean-defaults", "users-settings"])
def test_frozen_zero3_engine_holds_no_gathered_parameters_between_forwards(settings: dict) -> None:
    """A frozen ZeRO-3 teacher called twice per step: each layer is gathered for its forward alone, and nothing
    stays gathered after a forward. A user's explicit settings still win: with DeepSpeed's own values the
    layers ahead are gathered (prefetched) while a layer runs.
    """
    for rank, seen in enumerate(on_ranks(watch_gathered, settings)):
        assert len(seen["in_layer"]) == 3 * 2 * 4 and len(seen["after_forward"]) == 3 * 2
        assert seen["student_bucket"] == 64 * 64 + 64, "the student's reduce bucket must fit its gradients alone"
        others_in_layer = [names for names in seen["in_layer"] if names]
        after = [names for names in seen["after_forward"] if names]
        if settings:
            assert others_in_layer, "with DeepSpeed's own settings the next layers are gathered ahead"
        else:
            assert not others_in_layer, f"rank {rank}: other layers gathered in a layer's forward: {others_in_layer}"
            assert not after, f"rank {rank}: parameters left gathered after the teacher's forward: {after}"


def test_setup_moves_an_engines_submodule_to_the_device_only_after_its_cast() -> None:
    """bf16 fits with a frozen teacher built whole in fp32 in ``__init__`` (ZeRO-2, run replicated, and ZeRO-3):
    the teacher reaches the device only in bf16, through DeepSpeed, as under Lightning's DeepSpeedStrategy.
    Moved before the cast, it would be whole on a GPU in fp32. On a CPU the move is a no-op; the test records
    the dtype at each move (the GPU suite also checks the memory).
    """
    for result in on_ranks(move_teachers):
        assert_moved_in_bf16(result)


def assert_moved_in_bf16(result: dict) -> None:
    for stage in (2, 3):
        moves = result[stage]["moves"]
        assert moves, f"ZeRO-{stage}: the teacher never reached the device"
        assert set(moves) == {"torch.bfloat16"}, f"ZeRO-{stage}: the teacher was moved as {moves}"
