"""Resume at another world size (2 -> 1 and 1 -> 2 ranks): every engine equals plain PyTorch on the same batches.

Each run is one phase of a resume at another world size, for the EMA GAN with schedulers (Adam), per SPEC
``SOURCE:AVERAGE`` as in ``test_ema.py`` (the generator's and its EMA engine's ZeRO stages; the discriminator is
ZeRO-2), or ``distill:STAGE``: the distillation of ``test_checkpoint.py``'s resume runs, a frozen ZeRO-3 teacher
(saved, ``save_frozen=True``) and a student at STAGE (``distill-file:STAGE``: saved with ``checkpoint_format="file"``,
which each rank unpacks and converts on its own). Phase ``first`` trains 1 epoch and saves ``last.ckpt``; ``second``
resumes from it, at whatever world size this run has, and trains 1 more. The GAN's engines halve their learning
rate after each epoch (``StepLR``, stepped by the module); ``bf16`` trains in bf16-mixed. Each phase returns, on
every rank (the tests read rank 0's), {spec: {"weights": consolidated state dict at the end, "optimizer": Adam's
moments and fp32 weights per parameter at the end, "started": the same when training starts after the resume
(``second``, GAN only), "lrs": the learning rates at the end (GAN only)}}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed import test_checkpoint, test_ema
from tests.distributed.common import AtFitEnd, AtTrainStart, cpu_trainer
from tests.distributed.harness import on_ranks
from tests.distributed.test_checkpoint import optimizer_state

DECAY = 0.7
TOLERANCE = 1e-6
GANS = ["0:3", "1:0", "2:3", "3:3"]  # generator ZeRO-0/1/2/3 (discriminator ZeRO-2), its EMA engine ZeRO-0/3
SPECS = [*GANS, "distill:2", "distill-file:2"]  # a ZeRO-2 student beside a frozen ZeRO-3 teacher; saved as one file
OLD_FORMAT = "2:3"
"""Resumed from a checkpoint without its world size, as saved before the strategy recorded it."""


class ScheduledEmaGan(test_ema.EmaGan):
    """The EMA GAN of ``test_ema`` with a ``StepLR(gamma=0.5)`` per optimizer, stepped at each epoch's end."""

    def configure_optimizers(self) -> Any:
        optimizers = super().configure_optimizers()
        return optimizers, [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in optimizers]

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()


def read_optimizers(strategy: MultiDeepSpeedStrategy) -> list[torch.Tensor]:
    return [t for opt in strategy.optimizers for t in optimizer_state(opt.engine)]


def fit(spec: str, epochs: int, root: Path, ckpt_path: str | None = None, bf16: bool = False) -> dict[str, Any]:
    source, average = spec.split(":")
    if source.startswith("distill"):
        checkpoint_format = "file" if source == "distill-file" else "directory"
        return test_checkpoint.fit_resumable(
            "distill", int(average), epochs, root, ckpt_path=ckpt_path, checkpoint_format=checkpoint_format
        )
    strategy = MultiDeepSpeedStrategy(
        engine_configs={
            "generator": test_ema.zero(source),
            "discriminator": test_ema.zero("2"),
            "generator_ema": test_ema.zero(average),
        },
        ema={"generator_ema": ("generator", DECAY)},
    )
    at_start, at_end = AtTrainStart(read_optimizers), AtFitEnd(read_optimizers)
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        callbacks=[
            ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1),
            at_end,
            *([at_start] if ckpt_path else []),
        ],
        default_root_dir=root,
        precision="bf16-mixed" if bf16 else "32-true",
    )
    module = ScheduledEmaGan()
    trainer.fit(module, ckpt_path=ckpt_path)
    return {
        "weights": {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()},
        "optimizer": at_end.value,
        "started": at_start.value,
        "lrs": [opt.param_groups[0]["lr"] for opt in strategy.optimizers],
    }


def train_phase(root: Path, phase: str, specs: list[str], bf16: bool = False) -> dict[str, dict[str, Any]]:
    """On each rank: phase ``first`` or ``second`` of every spec, each under ``root / SPEC``; what each ended with."""
    results = {}
    for spec in specs:
        folder = root / spec.replace(":", "-")
        if phase == "first":
            results[spec] = fit(spec, 1, folder / "first", bf16=bf16)
        else:
            results[spec] = fit(spec, 2, folder / "second", ckpt_path=str(folder / "first" / "last.ckpt"), bf16=bf16)
    return results


def forget_world_size(lightning_part: Path) -> None:
    saved = torch.load(lightning_part, weights_only=False)
    del saved["multids"]["world_size"]
    torch.save(saved, lightning_part)


def reference() -> dict:
    """Plain PyTorch on the global batches for 2 epochs: the GAN with Adam and StepLR, and ``AveragedModel``."""
    G, D, _ = test_ema.make_gan()
    opt_g, opt_d = patterns.make_optimizer("adam", G.parameters()), patterns.make_optimizer("adam", D.parameters())
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (opt_g, opt_d)]
    average = AveragedModel(G, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    data, global_batch = patterns.make_batches(test_ema.BATCHES), 8
    for _ in range(2):
        for step in range(test_ema.BATCHES):
            batch = data[step * global_batch : (step + 1) * global_batch]
            patterns.gan_zero_first(G, D, batch, opt_g, opt_d, lambda loss: loss.backward())
            average.update_parameters(G)
        for scheduler in schedulers:
            scheduler.step()
    weights = {f"generator.{k}": v.detach().clone() for k, v in G.state_dict().items()}
    weights.update({f"discriminator.{k}": v.detach().clone() for k, v in D.state_dict().items()})
    weights.update({f"generator_ema.{k}": v.detach().clone() for k, v in average.module.state_dict().items()})
    optimizer = []
    for opt, module in ((opt_g, G), (opt_d, D)):
        for param in module.parameters():
            optimizer += [opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"], param.detach()]
    return {"weights": weights, "optimizer": optimizer, "lrs": [opt.param_groups[0]["lr"] for opt in (opt_g, opt_d)]}


def reshape(root: Path, saved_at: int, resumed_at: int, bf16: bool = False) -> tuple[dict, dict]:
    """Train 1 epoch at world size ``saved_at``, resume at ``resumed_at`` for 1 more: both runs' results (rank 0's)."""
    first = on_ranks(train_phase, root, "first", SPECS, bf16, world_size=saved_at, timeout=600)[0]
    forget_world_size(root / OLD_FORMAT.replace(":", "-") / "first" / "last.ckpt" / "lightning.pt")
    second = on_ranks(train_phase, root, "second", SPECS, bf16, world_size=resumed_at, timeout=600)[0]
    return first, second


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    first, second = reshape(tmp_path_factory.mktemp("reshape"), *request.param)
    return {spec: {**second[spec], "saved": first[spec]["optimizer"]} for spec in SPECS}


def reference_distill() -> dict:
    """Plain PyTorch for ``test_checkpoint.py``'s distillation, 2 epochs: the student with Adam, the teacher frozen."""
    teacher, student = patterns.make_distill_modules()
    teacher.eval().requires_grad_(False)
    opt = patterns.make_optimizer("adam", student.parameters())
    data, global_batch = patterns.make_batches(test_checkpoint.BATCHES), 8
    for _ in range(2):
        for step in range(test_checkpoint.BATCHES):
            batch = data[step * global_batch : (step + 1) * global_batch]
            patterns.distill_step(teacher, student, batch, opt, lambda loss: loss.backward())
    weights = {f"teacher.{k}": v.detach().clone() for k, v in teacher.state_dict().items()}
    weights.update({f"student.{k}": v.detach().clone() for k, v in student.state_dict().items()})
    optimizer = []
    for param in student.parameters():
        optimizer += [opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"], param.detach()]
    return {"weights": weights, "optimizer": optimizer}


@pytest.mark.parametrize("spec", SPECS)
def test_resume_at_another_world_size_equals_plain_pytorch(resumed: dict, spec: str) -> None:
    """Weights (the EMA engine's included), Adam's moments and fp32 weights, and the schedulers' learning rates."""
    expected, result = (reference_distill() if spec.startswith("distill") else reference()), resumed[spec]
    assert result["weights"].keys() == expected["weights"].keys()
    for key, value in expected["weights"].items():
        diff = (result["weights"][key] - value).abs().max().item()
        assert diff <= TOLERANCE, f"{spec} {key}: max abs difference {diff:.2e} from plain PyTorch"
    assert len(result["optimizer"]) == len(expected["optimizer"])
    for index, (got, want) in enumerate(zip(result["optimizer"], expected["optimizer"], strict=True)):
        diff = (got.float() - want).abs().max().item()
        assert diff <= TOLERANCE, f"{spec} optimizer state {index}: max abs difference {diff:.2e}"
    if "lrs" in expected:
        assert result["lrs"] == pytest.approx(expected["lrs"])


@pytest.mark.parametrize("spec", GANS)
def test_resume_at_another_world_size_starts_from_the_saved_state_exactly(resumed: dict, spec: str) -> None:
    assert_same_state(resumed[spec]["saved"], resumed[spec]["started"], spec)


def test_bf16_resume_at_another_world_size_starts_from_the_saved_state_exactly(tmp_path: Path) -> None:
    """bf16-mixed, 2 -> 1: the fp32 master weights and Adam's moments go through the conversion bit for bit."""
    first, second = reshape(tmp_path, 2, 1, bf16=True)
    for spec in GANS:
        assert_same_state(first[spec]["optimizer"], second[spec]["started"], f"bf16 {spec}")


def assert_same_state(saved: list[torch.Tensor], started: list[torch.Tensor], where: str) -> None:
    assert len(saved) == len(started) > 0
    for index, (a, b) in enumerate(zip(saved, started, strict=True)):
        assert torch.equal(a, b), f"{where}: optimizer state {index} changed between the save and the resume"
