"""Frozen (inference) engines, mixed ZeRO stages and DeepSpeed-config optimizers, against plain PyTorch.

The rank code of the fits, :func:`fit_specs`, fits each SPEC ``case:frozen_stage:trained_stage`` (a frozen stage
``3o``: ZeRO-3 with ``offload_param`` to the CPU) with case ``distill`` (frozen teacher, trained student),
``frozen_middle`` (loss = frozen critic(generator(z))), ``frozen_twice`` (the same and frozen critic(real) in one
loss), ``config_optimizer`` (the student's optimizer comes from its DeepSpeed config) or ``configure_model`` (the
distillation's submodules built in ``configure_model``), and returns what each ended with. The GPU suite runs it
too, on one GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._config import DEEPSPEED_ZERO3
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks, run_ranks

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


def test_zero3_teacher_never_exists_whole_in_one_process(tmp_path: Path) -> None:
    """Each rank's memory grows by about half a 64 MiB teacher while configure_model builds it, not all of it.

    glibc raises its mmap threshold as large blocks are freed and then keeps freed memory in the heap, so
    resident memory would count layers already partitioned and freed; a fixed threshold makes it count
    live memory only.
    """
    out = tmp_path / "memory.pt"
    run_ranks(Path(__file__).with_name("run_memory.py"), str(out), "build", env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    for rank in (0, 1):
        result = torch.load(f"{out}.{rank}")
        assert result["local_bytes"] == pytest.approx(result["teacher_bytes"] / 2, rel=0.01)
        assert result["growth"] < 0.75 * result["teacher_bytes"], (
            f"rank {rank}: memory grew by {result['growth'] / 2**20:.0f} MiB while building a "
            f"{result['teacher_bytes'] / 2**20:.0f} MiB teacher"
        )


@pytest.mark.parametrize("settings", [{}, DEEPSPEED_ZERO3], ids=["lean-defaults", "users-settings"])
def test_frozen_zero3_engine_holds_no_gathered_parameters_between_forwards(tmp_path: Path, settings: dict) -> None:
    """A frozen ZeRO-3 teacher called twice per step: each layer is gathered for its forward alone, and nothing
    stays gathered after a forward. A user's explicit settings still win: with DeepSpeed's own values the
    layers ahead are gathered (prefetched) while a layer runs.
    """
    out = tmp_path / "gathered.pt"
    run_ranks(Path(__file__).with_name("run_memory.py"), str(out), "gathered", json.dumps(settings))
    for rank in (0, 1):
        seen = torch.load(f"{out}.{rank}")
        assert len(seen["in_layer"]) == 3 * 2 * 4 and len(seen["after_forward"]) == 3 * 2
        assert seen["student_bucket"] == 64 * 64 + 64, "the student's reduce bucket must fit its gradients alone"
        others_in_layer = [names for names in seen["in_layer"] if names]
        after = [names for names in seen["after_forward"] if names]
        if settings:
            assert others_in_layer, "with DeepSpeed's own settings the next layers are gathered ahead"
        else:
            assert not others_in_layer, f"rank {rank}: other layers gathered in a layer's forward: {others_in_layer}"
            assert not after, f"rank {rank}: parameters left gathered after the teacher's forward: {after}"


def test_setup_moves_an_engines_submodule_to_the_device_only_after_its_cast(tmp_path: Path) -> None:
    """bf16 fits with a frozen teacher built whole in fp32 in ``__init__`` (ZeRO-2, run replicated, and ZeRO-3):
    the teacher reaches the device only in bf16, through DeepSpeed, as under Lightning's DeepSpeedStrategy.
    Moved before the cast, it would be whole on a GPU in fp32. On a CPU the move is a no-op; the test records
    the dtype at each move (the GPU suite also checks the memory).
    """
    out = tmp_path / "moved.pt"
    run_ranks(Path(__file__).with_name("run_memory.py"), str(out), "moved")
    for rank in (0, 1):
        assert_moved_in_bf16(torch.load(f"{out}.{rank}"))


def assert_moved_in_bf16(result: dict) -> None:
    for stage in (2, 3):
        moves = result[stage]["moves"]
        assert moves, f"ZeRO-{stage}: the teacher never reached the device"
        assert set(moves) == {"torch.bfloat16"}, f"ZeRO-{stage}: the teacher was moved as {moves}"
