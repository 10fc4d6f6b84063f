"""Save and resume every engine with Lightning's state, exactly; export to plain state dicts.

The resume runs' rank code, :func:`resume_runs`, follows ``assert_resumed_exactly``: per ZeRO stage, a GAN or a
distillation trained 2 epochs straight, and 1 epoch, saved, resumed for 1 more (the GPU suite runs it too, and
test_reshape fits the distillation with :func:`fit_resumable`). The other scenarios' rank code follows it: a GAN
trained 1 epoch at ZeRO-3 with ModelCheckpoint (:func:`train`), killed mid-save (:func:`fit_killed`), resumed
(:func:`resume`), validated from a checkpoint or inside ``gathered``, and fitted from bad checkpoint paths; each
returns what the tests read.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks


@pytest.mark.parametrize("case", ["gan", "distill"])
def test_resume_at_an_epoch_boundary_is_bitwise_exact(tmp_path: Path, case: str) -> None:
    for rank, results in enumerate(on_ranks(resume_runs, tmp_path, case, [0, 1, 2, 3], timeout=600)):
        assert_resumed_exactly(results, f"{case}, rank {rank}")
        saved = ["discriminator", "generator"] if case == "gan" else ["student", "teacher"]  # save_frozen for distill
        assert all(result["straight"]["parts"] == saved for result in results.values())


def test_a_refused_resume_from_one_file_names_that_file(tmp_path: Path) -> None:
    """Not the temporary directory each rank unpacks it into (removed by the time the message is read)."""
    options = ResumeOptions(resume_stage=3, straight=False, checkpoint_format="file")
    with pytest.raises(AssertionError, match="exited with") as failed:
        on_ranks(resume_runs, tmp_path, "gan", [2], options)
    message = str(failed.value)
    named = r"The checkpoint '[^']*/last\.ckpt' saved the engine '(generator|discriminator)' at ZeRO-2"
    assert re.search(named, message), message[-3000:]
    assert "multids-checkpoint-" not in message, message[-3000:]


@pytest.mark.parametrize(
    ("case", "stages", "flags"),
    [
        ("gan", "0123", {}),
        ("gan", "0123", {"bf16": True}),
        ("distill", "2", {}),
        ("distill", "23", {"ema": True, "inside_gathered": True}),
    ],
    ids=["gan", "gan-bf16", "distill", "distill-inside-gathered"],
)
def test_save_checkpoint_after_fit_resumes_bitwise_exactly(
    tmp_path: Path, case: str, stages: str, flags: dict[str, bool]
) -> None:
    """Lightning's documented ``trainer.fit(model); trainer.save_checkpoint(path)``, resumed with ``ckpt_path``.

    In bf16 the stopped engines' whole submodules are back in fp32 when it saves (as after teardown). Inside
    ``gathered`` of the ZeRO-3 teacher, student and EMA, the save writes what it writes outside.
    """
    options = ResumeOptions(after_fit=True, **flags)
    ranks = on_ranks(resume_runs, tmp_path, case, [int(s) for s in stages], options, timeout=600)
    for rank, results in enumerate(ranks):
        assert sorted(results) == [int(stage) for stage in stages]
        assert_resumed_exactly(results, f"{case} {flags} saved after fit, rank {rank}")


def test_resume_with_weights_only_true_is_bitwise_exact(tmp_path: Path) -> None:
    """``fit(ckpt_path=..., weights_only=True)`` at ZeRO 0-3 beside a frozen ZeRO-3 teacher and an EMA student.

    Every file the strategy and DeepSpeed write loads with ``torch.load(weights_only=True)``, allowing only the
    DeepSpeed classes that :func:`~lightning_multids._compat.deepspeed.checkpoint_globals` lists.
    """
    from lightning_multids._compat.deepspeed import checkpoint_globals

    options = ResumeOptions(ema=True, weights_only=True)
    ranks = on_ranks(resume_runs, tmp_path, "distill", [0, 1, 2, 3], options, timeout=600)
    for rank, results in enumerate(ranks):
        assert_resumed_exactly(results, f"distill with an EMA, weights_only=True, rank {rank}")
        assert all(result["straight"]["parts"] == ["student", "student_ema", "teacher"] for result in results.values())
    for stage in "0123":
        files = sorted((tmp_path / f"distill-{stage}" / "first" / "last.ckpt").rglob("*.pt"))
        assert len(files) >= 4, files  # lightning.pt, the student's model and optimizer states, two weights.pt
        with torch.serialization.safe_globals(checkpoint_globals()):
            for file in files:
                torch.load(file, weights_only=True)


def test_single_file_checkpoint_loads_with_torch_and_lightning_and_resumes_bitwise_exactly(tmp_path: Path) -> None:
    """``checkpoint_format="file"``: each save is one file; ``torch.load(weights_only=True)`` reads it with Lightning's
    keys and the whole weights keyed as in the module, ``load_from_checkpoint`` loads them, and ``fit(ckpt_path=...)``
    resumes exactly at ZeRO 0 and 3 beside a frozen ZeRO-3 teacher and an EMA student (``weights_only=True``)."""
    options = ResumeOptions(ema=True, weights_only=True, checkpoint_format="file")
    ranks = on_ranks(resume_runs, tmp_path, "distill", [0, 3], options, timeout=600)  # ZeRO-2: test_reshape, top-k
    for rank, results in enumerate(ranks):
        assert_resumed_exactly(results, f"distill with an EMA, one file, rank {rank}")
        assert all(result["straight"]["parts"] == ["student", "student_ema", "teacher"] for result in results.values())
    lightning_keys = {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "epoch", "global_step"}
    for stage, result in ranks[0].items():
        first = tmp_path / f"distill-{stage}" / "first"
        assert sorted(p.name for p in first.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"], stage  # no leftovers
        saved = torch.load(first / "last.ckpt", weights_only=True)
        assert lightning_keys <= saved.keys() and saved["global_step"] == 2, stage
        weights = result["first"]["weights"]
        assert saved["state_dict"].keys() == weights.keys(), stage
        assert all(torch.equal(saved["state_dict"][k], v) for k, v in weights.items()), stage
        loaded = Resumable.load_from_checkpoint(first / "last.ckpt", case="distill", ema=True).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in weights.items()), stage
        # the student's Adam as torch's state_dict(): its moments per parameter, whole (fit ended at the save)
        (adam,) = saved["optimizer_states"]
        moments = [adam["state"][i][key] for i in range(len(adam["state"])) for key in ("exp_avg", "exp_avg_sq")]
        live = [t for i, t in enumerate(result["first"]["optimizer"]) if i % 3 != 2]  # without the master weights
        assert len(moments) == len(live) > 0, stage
        assert all(torch.equal(a, b) for a, b in zip(moments, live, strict=True)), stage
        assert [int(adam["state"][i]["step"]) for i in adam["state"]] == [2] * len(adam["state"]), stage
        assert adam["param_groups"][0]["params"] == list(range(len(adam["state"]))), stage


@pytest.mark.parametrize(("saved", "resumed"), [(1, 2), (2, 1)])
def test_resume_between_zero1_and_zero2_is_exact(tmp_path: Path, saved: int, resumed: int) -> None:
    """DeepSpeed saves and loads ZeRO-1 and ZeRO-2 with one optimizer and one layout: a stage change between them."""
    for results in on_ranks(resume_runs, tmp_path, "gan", [saved], ResumeOptions(resume_stage=resumed), timeout=600):
        assert_resumed_exactly(results, f"ZeRO-{saved} -> {resumed}")


@pytest.mark.parametrize(("saved", "resumed"), [(2, 3), (3, 2), (0, 3), (3, 0), (2, 0), (0, 2)])
def test_resume_at_another_stage_is_refused_before_any_engine_loads(tmp_path: Path, saved: int, resumed: int) -> None:
    """Each of these failed inside DeepSpeed's load (an AssertionError with no message, a missing file...)."""
    with pytest.raises(AssertionError, match="exited with") as failed:
        on_ranks(resume_runs, tmp_path, "gan", [saved], ResumeOptions(resume_stage=resumed, straight=False))
    message = str(failed.value)
    expected = (
        rf"saved the engine '(generator|discriminator)' at ZeRO-{saved}, and it is ZeRO-{resumed} now.*Resume it at"
    )
    assert re.search(expected, message), message[-3000:]
    assert "MultiDeepSpeedStrategy: ValueError: The checkpoint" in message  # the strategy's, not DeepSpeed's


@pytest.mark.parametrize(
    ("stage", "saved_bf16"), [(0, True), (2, False), (3, True)], ids=["0-bf16", "2-fp32", "3-bf16"]
)
def test_resume_in_another_precision_is_refused_before_any_engine_loads(
    tmp_path: Path, stage: int, saved_bf16: bool
) -> None:
    """Saved in bf16 and resumed in fp32, or the other way: DeepSpeed failed inside its load (``KeyError:
    'param_groups'`` at ZeRO-0, a missing optimizer file at ZeRO-2)."""
    options = ResumeOptions(bf16=saved_bf16, resume_bf16=not saved_bf16, straight=False)
    with pytest.raises(AssertionError, match="exited with") as failed:
        on_ranks(resume_runs, tmp_path, "gan", [stage], options)
    message = str(failed.value)
    saved, now = ("bf16", "fp32") if saved_bf16 else ("fp32", "bf16")
    trainer = "bf16-mixed" if saved_bf16 else "32-true"
    expected = rf"saved the engine '(generator|discriminator)' in {saved}, and it trains in {now} now.*Resume it in "
    assert re.search(expected + rf"{saved} \(`Trainer\(precision='{trainer}'\)`", message), message[-3000:]
    assert "MultiDeepSpeedStrategy: ValueError: The checkpoint" in message  # the strategy's, not DeepSpeed's


@pytest.mark.parametrize(("stage", "bf16"), [(3, False), (2, True)], ids=["3", "2-bf16"])
def test_save_weights_only_writes_the_weights_and_no_optimizer_state(tmp_path: Path, stage: int, bf16: bool) -> None:
    """``ModelCheckpoint(save_weights_only=True)``: each engine's weights (the fp32 master copy where the engine keeps
    one, as DDP's fp32 module), no optimizer state; resuming from it is refused as Lightning refuses it under DDP."""
    from lightning_multids import consolidated_state_dicts

    expected = on_ranks(fit_weights_only, tmp_path, stage, bf16)[0]
    checkpoint = tmp_path / "last.ckpt"
    files = sorted(str(path.relative_to(checkpoint)) for path in checkpoint.rglob("*") if path.is_file())
    assert not [file for file in files if "optim" in file], files
    saved = consolidated_state_dicts(checkpoint)
    assert sorted(saved) == ["discriminator", "generator", "plain"]
    for name in ("generator", "discriminator"):
        assert saved[name].keys() == expected[name].keys()
        for key, value in expected[name].items():
            assert saved[name][key].dtype == torch.float32 and torch.equal(saved[name][key], value), f"{name}.{key}"
    with pytest.raises(AssertionError, match="checkpoint contains only the model"):
        on_ranks(resume_gan, tmp_path / "resumed", stage, str(checkpoint), bf16)


def resume_gan(root: Path, stage: int, ckpt_path: str, bf16: bool) -> dict:
    return fit_resumable("gan", stage, 2, root, ckpt_path, bf16=bf16)


def fit_weights_only(root: Path, stage: int, bf16: bool) -> dict[str, dict[str, torch.Tensor]]:
    """One epoch of the GAN with ``ModelCheckpoint(save_weights_only=True)``; each engine's fp32 weights at its end
    (in bf16, the engines' master copies)."""

    def weights(strategy: MultiDeepSpeedStrategy) -> dict[str, dict[str, torch.Tensor]]:
        if bf16:
            return {
                name: {key: safe_get_full_fp32_param(p).clone() for key, p in engine.module.named_parameters()}
                for name, engine in strategy.engines.items()
            }
        whole = strategy.consolidated_state_dict()
        return {
            name: {key.removeprefix(f"{name}."): value for key, value in whole.items() if key.startswith(f"{name}.")}
            for name in strategy.engines
        }

    at_end = AtFitEnd(weights)
    trainer = cpu_trainer(
        MultiDeepSpeedStrategy(stage=stage),
        precision="bf16-mixed" if bf16 else "32-true",
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_weights_only=True), at_end],
    )
    trainer.fit(Resumable("gan"))
    return at_end.value


def assert_resumed_exactly(results: dict, where: str) -> None:
    """Each stage's resumed run (1 epoch, save, resume, 1 more) equals the straight run to the bit."""
    for stage, result in results.items():
        straight, resumed = result["straight"], result["resumed"]
        where_stage = f"{where}, ZeRO-{stage}"
        assert resumed["global_step"] == straight["global_step"] > 0
        assert straight["weights"].keys() == resumed["weights"].keys()
        for key, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][key]), f"{where_stage}: {key} differs after resume"
        assert len(straight["optimizer"]) == len(resumed["optimizer"]) > 0
        for a, b in zip(straight["optimizer"], resumed["optimizer"], strict=True):
            assert torch.equal(a, b), f"{where_stage}: optimizer state differs after resume"
        assert "last.ckpt" in straight["files"] and not any(f.endswith(".partial") for f in straight["files"])


BATCHES = 2  # per epoch and rank of the resume runs


class Resumable(pl.LightningModule):
    def __init__(self, case: str, ema: bool = False) -> None:
        super().__init__()
        self.case = case
        self.automatic_optimization = False
        if case == "gan":
            self.generator, self.discriminator = patterns.make_modules()
        else:
            self.teacher, self.student = patterns.make_distill_modules()
            if ema:
                self.student_ema = copy.deepcopy(self.student)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.case == "gan":
            opt_g, opt_d = self.optimizers()
            patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)
        else:
            patterns.distill_step(self.teacher, self.student, batch, self.optimizers(), self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        trained = [self.generator, self.discriminator] if self.case == "gan" else [self.student]
        return [patterns.make_optimizer("adam", m.parameters()) for m in trained]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = patterns.make_batches(BATCHES)
        return sharded_loader(self, data)


def optimizer_state(engine: object) -> list[torch.Tensor]:
    """Adam's moments and the fp32 master weight of every parameter, whole (ZeRO partitions gathered).

    Read per parameter, so the padding at the end of a ZeRO partition (uninitialised memory) is left out. A bf16
    engine at stage 0 (DeepSpeed's ``FP16_UnfusedOptimizer`` with a torch Adam) keeps fp32 masters of its own.
    """
    state = []
    if engine.zero_optimization_stage() == 0 and engine.bfloat16_enabled():
        for master in (p for group in engine.optimizer.fp32_groups for p in group):
            moments = engine.optimizer.optimizer.state[master]
            state += [moments["exp_avg"].clone(), moments["exp_avg_sq"].clone(), master.detach().clone()]
        return state
    for param in engine.module.parameters():
        if engine.zero_optimization_stage() == 0:
            moments = engine.optimizer.state[param]
            state += [moments["exp_avg"].clone(), moments["exp_avg_sq"].clone(), param.detach().clone()]
        else:
            state += [safe_get_full_optimizer_state(param, key).clone() for key in ("exp_avg", "exp_avg_sq")]
            state.append(safe_get_full_fp32_param(param).clone())
    return state


class SavesInsideGathered(pl.Callback):
    """At the end of training, ``trainer.save_checkpoint`` inside ``gathered`` of every engine."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with contextlib.ExitStack() as blocks:
            for name in trainer.strategy.engines:  # type: ignore[attr-defined]
                blocks.enter_context(trainer.strategy.gathered(name))  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)


def fit_resumable(
    case: str,
    stage: int,
    epochs: int,
    root: Path,
    ckpt_path: str | None = None,
    save_after: bool = False,
    *,
    bf16: bool = False,
    ema: bool = False,
    weights_only: bool = False,
    inside_gathered: bool = False,
    checkpoint_format: str = "directory",
) -> dict:
    """Fit ``case`` at ``stage`` for ``epochs`` under ``root``, from ``ckpt_path`` if given; what it ended with.

    ``save_after``: ``trainer.save_checkpoint(root / "after-fit.ckpt")`` after ``fit`` returns, or with
    ``inside_gathered`` at ``on_train_end`` inside ``gathered`` of every engine.
    """
    flags = dict(precision="bf16-mixed") if bf16 else {}
    module = Resumable(case, ema=ema)
    engines = {"teacher": {"zero_optimization": {"stage": 3}}} if case == "distill" else {}
    averages = {"student_ema": ("student", 0.9)} if ema else None
    strategy = MultiDeepSpeedStrategy(
        stage=stage,
        engine_configs=engines,
        save_frozen=case == "distill" and checkpoint_format == "directory",  # one file holds every weight, as DDP's
        ema=averages,
        checkpoint_format=checkpoint_format,  # type: ignore[arg-type]
    )
    optimizers_at_end = AtFitEnd(lambda s: [t for opt in s.optimizers for t in optimizer_state(opt.engine)])
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1), optimizers_at_end],
        default_root_dir=root,
        **flags,
    )
    if save_after and inside_gathered:
        trainer.callbacks.append(SavesInsideGathered(root / "after-fit.ckpt"))
    trainer.fit(module, ckpt_path=ckpt_path, weights_only=True if weights_only else None)
    if save_after and not inside_gathered:
        trainer.save_checkpoint(root / "after-fit.ckpt")
    return {
        "weights": strategy.consolidated_state_dict(),
        "optimizer": optimizers_at_end.value,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "files": sorted(p.name for p in root.iterdir()),
        "parts": saved_parts(root / "last.ckpt"),
    }


def saved_parts(path: Path) -> list[str]:
    """The engines a checkpoint directory, or a single-file checkpoint, holds a part of."""
    if path.is_dir():
        return sorted(p.name for p in (path / "engines").iterdir())
    files = torch.load(path, weights_only=True)["multids"]["files"]
    return sorted({name.split("/")[1] for name in files if name.startswith("engines/")})


@dataclass(frozen=True)
class ResumeOptions:
    """How :func:`resume_runs` runs; each option but the last three goes to every :func:`fit_resumable`."""

    bf16: bool = False  # trains in bf16-mixed
    ema: bool = False  # adds student_ema, an EMA engine of the student (distill only)
    weights_only: bool = False  # resumes with weights_only=True
    inside_gathered: bool = False  # with after_fit: saves at on_train_end inside gathered of every engine
    after_fit: bool = False  # saves the first epoch with trainer.save_checkpoint after fit returns
    resume_stage: int | None = None  # resumes at this ZeRO stage, not the stage saved
    resume_bf16: bool | None = None  # resumes in bf16-mixed (True) or fp32 (False), not the precision saved
    checkpoint_format: str = "directory"  # MultiDeepSpeedStrategy(checkpoint_format=...) of every fit
    straight: bool = True  # False: no straight run


def resume_runs(root: Path, case: str, stages: list[int], options: ResumeOptions = ResumeOptions()) -> dict:
    """One rank: per stage, 2 epochs straight and 1 epoch, saved, resumed for 1 more, under ``root/CASE-STAGE``.

    ``case`` is ``gan`` (two engines, Adam) or ``distill`` (frozen ZeRO-3 teacher, saved with
    ``save_frozen=True``, Adam student). The first epoch is saved by ``ModelCheckpoint(save_last=True)``, or as
    ``options`` say. Returns {stage: {"straight": ..., "resumed": ...}}, each what :func:`fit_resumable` returned.
    """
    flags: dict[str, Any] = {"bf16": options.bf16, "ema": options.ema, "weights_only": options.weights_only}
    flags["inside_gathered"] = options.inside_gathered
    flags["checkpoint_format"] = options.checkpoint_format
    saved = "after-fit.ckpt" if options.after_fit else "last.ckpt"
    results = {}
    for stage in stages:
        folder = root / f"{case}-{stage}"
        plain = fit_resumable(case, stage, 2, folder / "straight", **flags) if options.straight else None
        first = fit_resumable(case, stage, 1, folder / "first", save_after=options.after_fit, **flags)
        resumed = fit_resumable(
            case,
            stage if options.resume_stage is None else options.resume_stage,
            2,
            folder / "second",
            ckpt_path=str(folder / "first" / saved),
            **{**flags, "bf16": options.bf16 if options.resume_bf16 is None else options.resume_bf16},
        )
        results[stage] = {"straight": plain, "first": first, "resumed": resumed}
    return results


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = patterns.make_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, z = patterns.split(batch)
        self.log("val_score", self.discriminator(self.generator(z)).mean(), sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(2), batch_size=4)

    val_dataloader = train_dataloader


class GatheredGAN(GAN):
    """The GAN sampling inside ``gathered``, as a generation loop would; then an edit of the generator inside
    ``gathered(modifier_rank=0)`` that changes nothing on rank 0 and halves the weights on rank 1 (dropped: rank 0's
    weights are every rank's), and the mean over ranks of the generator's weight sum read after it."""

    refused = ""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        real, z = patterns.split(batch)
        strategy = self.trainer.strategy
        with strategy.gathered("generator") as generator:  # type: ignore[attr-defined]
            fake = generator(z)
        self.log("val_score", self.discriminator(fake).mean(), sync_dist=True)
        with strategy.gathered("generator", modifier_rank=0) as generator:  # type: ignore[attr-defined]
            for param in generator.parameters():
                param.mul_(1.0 if self.global_rank == 0 else 0.5)
        with strategy.gathered("generator") as generator:  # type: ignore[attr-defined]
            self.log("weight_sum", sum(p.sum() for p in generator.parameters()), sync_dist=True)
        try:
            with strategy.gathered("generator", modifier_rank=7):  # type: ignore[attr-defined]
                pass
        except ValueError as error:
            self.refused = str(error)


class Student(pl.LightningModule):
    """A module with other engines than the GAN's, to resume a GAN checkpoint into."""

    def __init__(self) -> None:
        super().__init__()
        _, self.student = patterns.make_distill_modules()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.student(batch[:, :6]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.1)

    train_dataloader = GAN.train_dataloader


class Scored(Student):
    """The student with Adam, logging each epoch a score whose best epochs are 1, then 2 (0 worse: its file is
    removed)."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.log("score", -abs(self.current_epoch - 1.2), on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters(), lr=0.01)


def top_k_under_both(root: Path) -> dict[str, dict[str, Any]] | None:
    """On each rank: 3 epochs of :class:`Scored` with ``ModelCheckpoint(save_top_k=2, save_last=True)`` on its score,
    under ``DDPStrategy`` and under ``MultiDeepSpeedStrategy(checkpoint_format="file")`` at ZeRO-2 (ROOT/ddp,
    ROOT/multids); rank 0 returns, for each, the files left in the folder, the callback's best and top-k paths, and
    the weights after ``DDPStrategy`` resumed from its ``last.ckpt`` for a fourth epoch."""
    results = {}
    for name, strategy in (
        ("ddp", pl.strategies.DDPStrategy()),
        ("multids", MultiDeepSpeedStrategy(stage=2, checkpoint_format="file")),
    ):
        callback = ModelCheckpoint(dirpath=root / name, monitor="score", mode="max", save_top_k=2, save_last=True)
        fitted = cpu_trainer(strategy, max_epochs=3, callbacks=[callback])
        fitted.fit(Scored())
        results[name] = {
            "files": sorted(p.name for p in (root / name).iterdir()),
            "best": Path(callback.best_model_path).name,
            "top_k": sorted(Path(path).name for path in callback.best_k_models),
        }
    for name in ("ddp", "multids"):  # each last.ckpt resumed under DDP for a fourth epoch
        module = Scored()
        resumed = cpu_trainer(pl.strategies.DDPStrategy(), max_epochs=4, enable_checkpointing=False)
        resumed.fit(module, ckpt_path=str(root / name / "last.ckpt"))
        results[name]["resumed_by_ddp"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return results if torch.distributed.get_rank() == 0 else None


def trainer(root: Path, epochs: int) -> pl.Trainer:
    return cpu_trainer(
        MultiDeepSpeedStrategy(stage=3),
        max_epochs=epochs,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpts", save_last=True, save_top_k=-1)],
    )


def kill_during_second_save() -> None:
    """SIGKILL rank 1 after it wrote its first engine of the second checkpoint, before the second engine."""
    original, calls = DeepSpeedEngine.save_checkpoint, []

    def save_checkpoint(self: DeepSpeedEngine, *args: object, **kwargs: object) -> object:
        calls.append(1)
        # epoch 0 writes epoch=0-step=4.ckpt and last.ckpt (2 engines each); die inside epoch=1-step=8.ckpt
        if len(calls) == 6 and os.environ["LOCAL_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    DeepSpeedEngine.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def kill_between_renames() -> None:
    """SIGKILL rank 0 right after it moved last.ckpt aside (to last.old.ckpt), before the new one takes its place."""
    from lightning_multids import checkpoint

    original = os.replace

    def replace(source: object, target: object) -> None:
        original(source, target)
        if Path(str(target)).name == "last.old.ckpt":
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.os.replace = replace  # type: ignore[attr-defined]


class StartEpoch(pl.Callback):
    """The epoch training starts at, after any resume."""

    def __init__(self) -> None:
        self.value = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.value = trainer.current_epoch


def train(root: Path) -> dict[str, Any] | None:
    """On each rank: 1 epoch of the GAN at ZeRO-3 with ModelCheckpoint, then ROOT/single.ckpt saved after fit as one
    file (``checkpoint_format="file"``); then :class:`Student` (SGD) at ZeRO-2 saved as one file, ROOT/sgd.ckpt. Rank 0
    returns the GAN's live weights and the warnings of the student's save."""
    t = trainer(root, 1)
    t.fit(GAN())
    t.strategy.checkpoint_format = "file"  # type: ignore[attr-defined]
    t.save_checkpoint(root / "single.ckpt")
    weights = t.strategy.consolidated_state_dict()
    sgd = cpu_trainer(MultiDeepSpeedStrategy(stage=2, checkpoint_format="file"), enable_checkpointing=False)
    sgd.fit(Student())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgd.save_checkpoint(root / "sgd.ckpt")
    return {"live": weights, "sgd": [str(w.message) for w in caught]} if t.global_rank == 0 else None


def fit_killed(root: Path, when: str) -> None:
    """On each rank: 2 epochs; killed ``during_second_save`` (rank 1) or ``between_renames`` (rank 0)."""
    if when == "during_second_save":
        kill_during_second_save()
    else:
        kill_between_renames()
    trainer(root, 2).fit(GAN())


def resume(root: Path, ckpt_path: str) -> dict[str, int] | None:
    """On each rank: resume from ``ckpt_path`` up to a third epoch; rank 0 returns where training started and ended."""
    t, start = trainer(root, 3), StartEpoch()
    t.callbacks.append(start)  # type: ignore[attr-defined]
    t.fit(GAN(), ckpt_path=ckpt_path)
    return {"start_epoch": start.value, "epoch": t.current_epoch, "step": t.global_step} if t.global_rank == 0 else None


def validate(root: Path) -> dict[str, dict[str, float]]:
    """On each rank: ``trainer.validate(ckpt_path=...)`` in a fresh process, from ROOT/ckpts/last.ckpt (a directory)
    and from ROOT/single.ckpt (one file); the metrics of each, by file name."""
    metrics = {}
    for path in (root / "ckpts" / "last.ckpt", root / "single.ckpt"):
        (metrics[path.name],) = cpu_trainer(MultiDeepSpeedStrategy(stage=3)).validate(GAN(), ckpt_path=str(path))
    return metrics


def validate_gathered() -> dict[int, tuple[float, float, str]]:
    """On each rank: ``trainer.validate`` at ZeRO 0-3 of :class:`GatheredGAN`; by stage, its val_score, the weight sum
    and the refusal of a modifier rank that is no rank."""
    results = {}
    for stage in range(4):
        module = GatheredGAN()
        (metrics,) = cpu_trainer(MultiDeepSpeedStrategy(stage=stage)).validate(module)
        results[stage] = (metrics["val_score"], metrics["weight_sum"], module.refused)
    return results


def fit_from_bad_paths(root: Path) -> dict[str, str]:
    """On each rank: fit from bad ckpt_path values; each one's error message (or ``no error``) by its name."""
    (root / "plain.ckpt").write_bytes(b"not a checkpoint")
    cases = {
        "missing": (GAN, root / "nowhere.ckpt"),
        "not_ours": (GAN, root / "plain.ckpt"),
        "other_engines": (Student, root / "ckpts" / "last.ckpt"),
    }
    messages = {}
    for name, (module, path) in cases.items():
        try:
            trainer(root / name, 2).fit(module(), ckpt_path=str(path))
        except ValueError as err:
            messages[name] = str(err).replace("\n", " ")
        else:
            messages[name] = "no error"
    return messages


def fit_with_urls(root: Path) -> dict[str, str]:
    """On each rank, in ROOT: fits and saves with fsspec URLs; each one's error message (or ``no error``) by name."""
    os.chdir(root)
    url = f"file://{root}/ckpts/last.ckpt"
    memory = ModelCheckpoint(dirpath="memory://run/ckpts")
    cases = {
        "file_resume": lambda: trainer(root / "file", 2).fit(GAN(), ckpt_path=url),
        "file_save": lambda: fitted.save_checkpoint(f"file://{root}/saved.ckpt"),
        "memory_save": lambda: fitted.save_checkpoint("memory://run/model.ckpt"),
        "memory_dirpath": lambda: cpu_trainer(MultiDeepSpeedStrategy(stage=3), callbacks=[memory]).fit(GAN()),
    }
    fitted = trainer(root / "fitted", 1)
    fitted.fit(GAN())
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except ValueError as err:
            messages[name] = str(err).replace("\n", " ")
        else:
            messages[name] = "no error"
    return messages


def test_fsspec_urls_are_local_files_or_refused_at_once(trained: Path) -> None:
    messages = on_ranks(fit_with_urls, trained)[0]
    assert messages["file_resume"] == "no error" and messages["file_save"] == "no error", messages
    assert (trained / "saved.ckpt" / "lightning.pt").is_file()
    for name, what in (
        ("memory_save", "`trainer.save_checkpoint`'s path 'memory://run/model.ckpt'"),
        ("memory_dirpath", "`ModelCheckpoint(dirpath=...)` 'memory://run/ckpts'"),
    ):
        expected = rf"^{re.escape(what)} is on fsspec's 'memory' filesystem.*Save to a local directory.*\.put\("
        assert re.search(expected, messages[name]), messages[name]
    assert not list(trained.glob("memory*")), "a URL became a local folder"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ZeRO-3 GAN trained for one epoch, with its checkpoints and its live weights (ROOT/live.pt)."""
    root = tmp_path_factory.mktemp("ckpt")
    trained = on_ranks(train, root)[0]
    torch.save(trained["live"], root / "live.pt")
    (root / "sgd-warnings.txt").write_text("\n".join(trained["sgd"]))
    return root


def test_checkpoint_is_one_directory_with_a_part_per_engine(trained: Path) -> None:
    last = trained / "ckpts" / "last.ckpt"
    assert (last / "lightning.pt").is_file()
    assert sorted(p.name for p in (last / "engines").iterdir()) == ["discriminator", "generator"]
    lightning = torch.load(last / "lightning.pt", weights_only=False)
    assert lightning["global_step"] == 4  # 2 batches x 2 optimizers (manual optimization)
    assert "loops" in lightning and "callbacks" in lightning


def test_export_gives_plain_state_dicts_equal_to_the_live_weights(trained: Path, tmp_path: Path) -> None:
    from lightning_multids.checkpoint import export

    written = export(trained / "ckpts" / "last.ckpt", tmp_path)  # no process group in this process
    assert sorted(p.name for p in written) == ["discriminator.pt", "generator.pt", "plain.pt"]
    live = torch.load(trained / "live.pt")
    generator, discriminator = patterns.make_modules(seed=5)  # fresh, different weights; no DeepSpeed
    generator.load_state_dict(torch.load(tmp_path / "generator.pt"))
    discriminator.load_state_dict(torch.load(tmp_path / "discriminator.pt"))
    for prefix, module in (("generator", generator), ("discriminator", discriminator)):
        for key, value in module.state_dict().items():
            assert torch.equal(value, live[f"{prefix}.{key}"]), f"{prefix}.{key}"


def test_export_as_one_lightning_file_loads_with_load_from_checkpoint(trained: Path, tmp_path: Path) -> None:
    """``Model.load_from_checkpoint`` takes a file; ``export(..., format="lightning")`` makes one of the directory."""
    from lightning_multids.checkpoint import export

    last = trained / "ckpts" / "last.ckpt"
    with pytest.raises(IsADirectoryError):  # Lightning's own, as under DeepSpeedStrategy: a checkpoint is a directory
        GAN.load_from_checkpoint(last)
    assert export(last, tmp_path, format="lightning") == [tmp_path / "model.ckpt"]
    assert_live_weights(GAN.load_from_checkpoint(tmp_path / "model.ckpt"), trained)


def assert_live_weights(loaded: pl.LightningModule, trained: Path) -> None:
    live = torch.load(trained / "live.pt")
    assert loaded.state_dict().keys() == live.keys()  # strict loading also refused a missing or unexpected key
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, live[key]), key


def test_load_from_checkpoint_reads_a_directory_through_as_file_and_a_single_file_checkpoint(trained: Path) -> None:
    """``Model.load_from_checkpoint`` opens one file: ``as_file(directory)`` is one, in memory; a checkpoint saved
    with ``checkpoint_format="file"`` (after fit, at ZeRO-3) is one on disk, that ``torch.load`` reads too."""
    from lightning_multids.checkpoint import as_file

    assert_live_weights(GAN.load_from_checkpoint(as_file(trained / "ckpts" / "last.ckpt")), trained)
    single = trained / "single.ckpt"
    assert single.is_file() and not list(trained.glob("single.ckpt.*"))  # nothing left beside it
    assert_live_weights(GAN.load_from_checkpoint(single), trained)
    assert_live_weights(GAN.load_from_checkpoint(as_file(single)), trained)
    saved = torch.load(single, weights_only=True)
    assert saved["global_step"] == 4 and len(saved["optimizer_states"]) == 2 and "loops" in saved


def test_a_single_file_save_of_a_zero2_sgd_engine_warns_that_its_optimizer_entry_is_empty(trained: Path) -> None:
    """DeepSpeed's universal conversion, which merges ZeRO partitions, fails on SGD's state (0.19.8: ``KeyError``)."""
    warned = (trained / "sgd-warnings.txt").read_text()
    assert re.search(r"optimizer_states` entry of the engine 'student' \(ZeRO-2\) is empty.*Adam's state only", warned)
    assert "use Adam/AdamW or ZeRO-0 for that engine" in warned, warned
    saved = torch.load(trained / "sgd.ckpt", weights_only=True)
    assert saved["optimizer_states"] == [{}] and set(saved["state_dict"]) == set(Student().state_dict())


def test_export_and_consolidated_state_dicts_read_a_single_file_checkpoint(trained: Path, tmp_path: Path) -> None:
    from lightning_multids.checkpoint import consolidated_state_dicts, export

    single, directory = trained / "single.ckpt", trained / "ckpts" / "last.ckpt"
    assert single.is_file()
    for name, state in consolidated_state_dicts(directory).items():
        assert all(torch.equal(value, consolidated_state_dicts(single)[name][k]) for k, value in state.items()), name
    written = export(single, tmp_path)
    assert sorted(p.name for p in written) == ["discriminator.pt", "generator.pt", "plain.pt"]
    live = torch.load(trained / "live.pt")
    for key, value in torch.load(tmp_path / "generator.pt").items():
        assert torch.equal(value, live[f"generator.{key}"]), key


def test_export_command_line(trained: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The command's entry point in this process (the poisoned-part test checks the command's own exit status)."""
    from lightning_multids.cli import main

    out = tmp_path / "exported"
    main(["export", str(trained / "ckpts" / "last.ckpt"), str(out), "--dtype", "bf16"])
    result = capfd.readouterr()
    assert "Loading checkpoint shards" not in result.err  # DeepSpeed's bar, once per ZeRO engine merged
    printed = result.out.splitlines()
    loads = f'model.generator.load_state_dict(torch.load("{out}/generator.pt"))'
    assert f"{out}/generator.pt  the state_dict of submodule generator: {loads}" in printed
    assert any(line.startswith(f"{out}/plain.pt  the entries of submodules without an engine") for line in printed)
    generator = torch.load(out / "generator.pt")
    live = torch.load(trained / "live.pt")
    assert (out / "discriminator.pt").is_file()
    for key, value in generator.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, live[f"generator.{key}"].to(torch.bfloat16))


def test_export_format_hf_of_a_checkpoint_without_hugging_face_engines_is_one_line(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_multids.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(trained / "ckpts" / "last.ckpt"), str(tmp_path), "--format", "hf"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "No engine of" in error and "holds a Hugging Face model" in error and "default format" in error
    assert "Traceback" not in error and not list(tmp_path.iterdir())


def test_export_merge_lora_needs_format_hf(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_multids.checkpoint import export
    from lightning_multids.cli import main

    with pytest.raises(SystemExit):
        main(["export", str(trained / "ckpts" / "last.ckpt"), str(tmp_path), "--merge-lora"])
    assert "--merge-lora needs --format hf" in capsys.readouterr().err
    with pytest.raises(ValueError, match="choose 'pt' .*, 'hf' .* or 'lightning'"):
        export(trained / "ckpts" / "last.ckpt", tmp_path, format="safetensors")


def test_validate_from_a_checkpoint_in_a_fresh_process(trained: Path) -> None:
    metrics = on_ranks(validate, trained)[0]
    live = torch.load(trained / "live.pt")
    generator, discriminator = patterns.make_modules()
    generator.load_state_dict({k.split(".", 1)[1]: v for k, v in live.items() if k.startswith("generator.")})
    discriminator.load_state_dict({k.split(".", 1)[1]: v for k, v in live.items() if k.startswith("discriminator.")})
    _, z = patterns.split(patterns.make_batches(2))
    expected = discriminator(generator(z)).mean().item()
    assert metrics["last.ckpt"]["val_score"] == pytest.approx(expected, abs=1e-6)
    assert metrics["single.ckpt"]["val_score"] == pytest.approx(expected, abs=1e-6)
    assert (trained / "single.ckpt").is_file()


def test_gathered_in_validation_step_works_under_validate_at_every_stage(tmp_path: Path) -> None:
    """Outside fit only ZeRO-3 submodules get an engine; ``gathered`` of a whole one only turns gradients off."""
    generator, discriminator = patterns.make_modules()
    _, z = patterns.split(patterns.make_batches(2))
    expected = discriminator(generator(z)).mean().item()
    weight_sum = sum(p.sum() for p in generator.parameters()).item()
    for stage, (score, weights, refused) in on_ranks(validate_gathered)[0].items():
        assert score == pytest.approx(expected, abs=1e-6), f"ZeRO-{stage}: {score}"
        assert weights == pytest.approx(weight_sum, abs=1e-5), f"ZeRO-{stage}: rank 1's edit was kept"
        assert "`gathered('generator', modifier_rank=7)`: the modifier rank is the global rank" in refused, stage


def test_bad_checkpoint_paths_fail_clearly(trained: Path) -> None:
    messages = on_ranks(fit_from_bad_paths, trained)[0]
    assert re.search(r"nowhere.ckpt' does not exist.*checkpoints/last.ckpt", messages["missing"]), messages["missing"]
    assert re.search(r"plain.ckpt' is not a MultiDeepSpeedStrategy checkpoint", messages["not_ours"])
    assert re.search(
        r"holds the engines \['discriminator', 'generator'\].*trains \['student'\]", messages["other_engines"]
    )


def test_single_file_checkpoints_keep_lightnings_top_k_contract_as_under_ddp(tmp_path: Path) -> None:
    """``checkpoint_format="file"`` under ``ModelCheckpoint(save_top_k=2, save_last=True)``, on the code that
    ``DDPStrategy`` runs: one file per save, the same files left (the worse ones removed), ``best_model_path``
    loadable by ``torch.load(weights_only=True)`` with DDP's keys and by ``load_from_checkpoint``, DDP's weights and
    Adam's state as DDP writes it (torch's ``state_dict()``), from which ``DDPStrategy`` resumes as from its own."""
    results = on_ranks(top_k_under_both, tmp_path)[0]
    ddp, ours = results["ddp"], results["multids"]
    assert ours["files"] == ddp["files"] == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"], results
    assert ours["best"] == ddp["best"] == "epoch=1-step=4.ckpt" and ours["top_k"] == ddp["top_k"], results
    for name in ddp["files"]:
        assert (tmp_path / "multids" / name).is_file(), name
        expected, saved = (torch.load(tmp_path / d / name, weights_only=True) for d in ("ddp", "multids"))
        assert saved.keys() - {"multids"} == expected.keys(), name
        assert saved["state_dict"].keys() == expected["state_dict"].keys(), name
        for key, value in expected["state_dict"].items():
            assert torch.allclose(saved["state_dict"][key], value, atol=1e-6), f"{name}: {key}"
        (adam,), (ddp_adam,) = saved["optimizer_states"], expected["optimizer_states"]  # torch's state_dict() of each
        assert adam["param_groups"] == ddp_adam["param_groups"] and adam["state"].keys() == ddp_adam["state"].keys()
        for index, state in ddp_adam["state"].items():
            assert state.keys() == adam["state"][index].keys(), f"{name}: {index}"
            assert all(torch.allclose(adam["state"][index][k], v, atol=1e-6) for k, v in state.items()), name
    loaded = Scored.load_from_checkpoint(tmp_path / "multids" / ours["best"]).state_dict()
    best = torch.load(tmp_path / "ddp" / ddp["best"], weights_only=True)["state_dict"]
    assert all(torch.allclose(loaded[key], value, atol=1e-6) for key, value in best.items())
    # DDPStrategy resumes training from the file as from its own: its weights, Adam's state, the loops
    for key, value in ddp["resumed_by_ddp"].items():
        assert torch.allclose(ours["resumed_by_ddp"][key], value, atol=1e-6), key


def test_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exited with|did not finish"):
        on_ranks(fit_killed, tmp_path, "during_second_save", timeout=120)
    ckpts = tmp_path / "ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert "epoch=0-step=4.ckpt" in names and "last.ckpt" in names
    assert any(name.endswith(".partial") for name in names), names  # the interrupted save
    last = torch.load(ckpts / "last.ckpt" / "lightning.pt", weights_only=False)
    assert last["epoch"] == 0, "last.ckpt must still be the complete epoch-0 checkpoint"
    assert on_ranks(resume, tmp_path, str(ckpts / "last.ckpt"))[0] == {"start_epoch": 1, "epoch": 3, "step": 12}


def test_a_save_killed_between_its_renames_keeps_the_last_checkpoint_for_ckpt_path_last(tmp_path: Path) -> None:
    """Replacing last.ckpt moves it to last.old.ckpt first; killed right then, ``ckpt_path="last"`` finds it."""
    with pytest.raises(AssertionError, match="exited with|did not finish"):
        on_ranks(fit_killed, tmp_path, "between_renames", timeout=120)
    ckpts = tmp_path / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir() if "last" in p.name) == ["last.ckpt.partial", "last.old.ckpt"]
    assert on_ranks(resume, tmp_path, "last")[0] == {"start_epoch": 1, "epoch": 3, "step": 12}
    assert sorted(p.name for p in ckpts.iterdir() if "last" in p.name) == ["last.ckpt"]  # the old one, once replaced


def test_loading_a_path_whose_replacement_died_finds_the_old_one(tmp_path: Path) -> None:
    from lightning_multids.checkpoint import resolve

    (tmp_path / "last.old.ckpt").mkdir()
    (tmp_path / "last.old.ckpt" / "lightning.pt").touch()
    (tmp_path / "final.old").mkdir()
    (tmp_path / "final.old" / "lightning.pt").touch()
    assert resolve(tmp_path / "last.ckpt") == tmp_path / "last.old.ckpt"
    assert resolve(tmp_path / "final") == tmp_path / "final.old"
