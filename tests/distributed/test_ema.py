"""EMA engines (``MultiDeepSpeedStrategy(ema=...)``) against ``torch.optim.swa_utils.AveragedModel``, 2 ranks.

The rank code, :func:`fit_all`, trains a GAN whose generator has an EMA engine, straight or saved after one epoch
and resumed, per SPEC ``SOURCE:AVERAGE[:resumed|:plain|:inside]``: a ZeRO stage each for the generator and its
average (``plain``: resumed without ``ema=``, the average a plain submodule then; ``inside``: resumed from a
checkpoint saved inside ``gathered("generator_ema")``, beside the consolidated state dict read there and outside,
as "inside" and "outside"); ``3p0`` is stage 3 with ``stage3_param_persistence_threshold: 0`` (no parameter stays
gathered between forwards, so the average updates partitions only). Each rank returns {spec: {"weights":
consolidated state dict after fit, "start": the average's weights when training starts, "checkpoint"}}.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.checkpoint import export
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

DECAY = 0.7  # far from 1, so that an average that skipped, repeated or mis-weighted an update shows
BATCHES = 2  # per epoch and rank
STEPS = 2 * BATCHES  # 2 epochs
TOLERANCE = 1e-6
SPECS = ["0:0", "2:0", "3p0:0", "2:3", "2:3p0", "3:3p0", "3p0:3p0", "2:3:resumed", "2:3p0:resumed", "3p0:3p0:resumed"]
SPECS += ["2:3:inside", "3p0:3p0:inside"]  # resumed from a save inside `gathered("generator_ema")`
PLAIN = ["2:3:plain", "3:0:plain"]  # resumed without `ema=`: the average is a plain submodule in the second run


class Counted(nn.Sequential):
    """``nn.Sequential`` with a buffer counting its training-mode calls: what the average copies, not averages."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x)


def make_gan() -> tuple[Counted, nn.Module, Counted]:
    """Generator, discriminator, and a generator of other weights for the average (setup copies the source in)."""
    generator, discriminator = patterns.make_modules()
    other, _ = patterns.make_modules(seed=7)
    return Counted(*generator), discriminator, Counted(*other)


class EmaGan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator, self.generator_ema = make_gan()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        patterns.gan_zero_first(self.generator, self.discriminator, batch, opt_g, opt_d, self.manual_backward)
        with torch.no_grad():  # a forward gathers a ZeRO-3 average's persistent parameters, which then stay whole
            self.generator_ema(patterns.split(batch)[1])

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [patterns.make_optimizer("adam", m.parameters()) for m in (self.generator, self.discriminator)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(BATCHES))


class AtTrainStart(pl.Callback):
    """The average's whole weights when training starts (after setup, before any step)."""

    def __init__(self) -> None:
        self.value: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        self.value = {k: v.clone() for k, v in state.items() if k.startswith("generator_ema.")}


class SavesInsideGathered(pl.Callback):
    """At the end of the first epoch: ``save_checkpoint`` and ``consolidated_state_dict`` inside ``gathered``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inside: dict[str, torch.Tensor] = {}
        self.outside: dict[str, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        with strategy.gathered("generator_ema"):  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)
            self.inside = strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        self.outside = strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def zero(stage: str) -> dict[str, Any]:
    if stage == "3p0":
        return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return {"zero_optimization": {"stage": int(stage)}}


def fit(
    spec: str, decay: float, epochs: int, root: Path, ckpt_path: str | None = None, *callbacks: pl.Callback
) -> dict[str, Any]:
    source, average = spec.split(":")[:2]
    plain = spec.endswith(":plain") and ckpt_path is not None
    configs = {"generator": zero(source), "discriminator": zero("2"), "generator_ema": zero(average)}
    strategy = MultiDeepSpeedStrategy(
        engine_configs={k: v for k, v in configs.items() if not (plain and k == "generator_ema")},
        ema=None if plain else {"generator_ema": ("generator", decay)},
    )
    start = AtTrainStart()
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1), start, *callbacks],
        default_root_dir=root,
    )
    trainer.fit(EmaGan(), ckpt_path=ckpt_path)
    weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
    return {"weights": weights, "start": start.value, "checkpoint": str(root / "last.ckpt")}


def fit_all(decay: float, specs: list[str], root: Path) -> dict[str, dict[str, Any]]:
    """One rank: every spec, each under ``root / SPEC`` (``:`` as ``-``); what each fit ended with."""
    results = {}
    for spec in specs:
        folder = root / spec.replace(":", "-")
        if spec.endswith(":inside"):
            inside = SavesInsideGathered(folder / "first" / "inside.ckpt")
            fit(spec, decay, 1, folder / "first", None, inside)
            results[spec] = fit(spec, decay, 2, folder / "second", str(inside.path))
            results[spec].update(
                inside=inside.inside, outside=inside.outside, files=sorted(os.listdir(folder / "first"))
            )
        elif spec.endswith((":resumed", ":plain")):
            fit(spec, decay, 1, folder / "first")
            results[spec] = fit(spec, decay, 2, folder / "second", ckpt_path=str(folder / "first" / "last.ckpt"))
        else:
            results[spec] = fit(spec, decay, 2, folder)
    return results


def reference(steps: int = STEPS, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process on the global batches: the GAN, and ``AveragedModel`` after each G step."""
    G, D, _ = make_gan()
    opt_g, opt_d = patterns.make_optimizer("adam", G.parameters()), patterns.make_optimizer("adam", D.parameters())
    average = AveragedModel(G, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    data = patterns.make_batches(BATCHES, global_batch)
    for step in range(steps):
        batch = data[step % BATCHES * global_batch : (step % BATCHES + 1) * global_batch]
        patterns.gan_zero_first(G, D, batch, opt_g, opt_d, lambda loss: loss.backward())  # opt_g.step() comes last
        average.update_parameters(G)
    out = {f"generator.{k}": v.detach().clone() for k, v in G.state_dict().items()}
    out.update({f"generator_ema.{k}": v.detach().clone() for k, v in average.module.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return on_ranks(fit_all, DECAY, [*SPECS, *PLAIN], tmp_path_factory.mktemp("ema"), timeout=600)[0]


def test_the_reference_average_lags_the_generator() -> None:
    """The comparison can fail: the average differs from the generator and from a copy of it."""
    expected = reference()
    lag = max((expected[f"generator_ema.{k}"] - expected[f"generator.{k}"]).abs().max().item() for k in ("0.weight",))
    assert lag > 1e-3, f"the average is within {lag:.1e} of the generator: the test could not tell them apart"
    assert expected["generator_ema.calls"] == 2 * STEPS, "the buffer is copied: 2 generator calls per batch"


@pytest.mark.parametrize("spec", SPECS)
def test_average_matches_plain_pytorch(results: dict, spec: str) -> None:
    """Generator at ZeRO {0,2,3} x average at {0,3}, with and without persistent ZeRO-3 parameters, straight and
    resumed: the generator and its average equal plain PyTorch with ``AveragedModel`` (Adam) within 1e-6."""
    weights = results[spec]["weights"]
    for key, expected in reference().items():
        diff = (weights[key] - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{spec} {key}: max abs difference {diff:.2e} from plain PyTorch"


@pytest.mark.parametrize("spec", PLAIN)
def test_a_resume_without_ema_loads_the_saved_average_into_the_plain_submodule(results: dict, spec: str) -> None:
    """As DDP restores the whole module: the average keeps what it was saved with (1 epoch), not its initial weights."""
    saved = reference(steps=STEPS // 2)
    weights = results[spec]["weights"]
    for key, expected in saved.items():
        if key.startswith("generator_ema.") and key != "generator_ema.calls":  # a plain submodule's calls still count
            diff = (weights[key] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"{spec} {key}: max abs difference {diff:.2e} from the saved average"


@pytest.mark.parametrize("spec", [s for s in SPECS if s.endswith(":inside")])
def test_saving_inside_gathered_writes_the_same_checkpoint_and_state(results: dict, spec: str) -> None:
    """Inside ``gathered`` of a ZeRO-3 average, ``save_checkpoint`` completes (no ``.partial`` left; the resume from
    it matches plain PyTorch above) and ``consolidated_state_dict`` equals the one read outside the block."""
    assert "inside.ckpt" in results[spec]["files"] and not any(f.endswith(".partial") for f in results[spec]["files"])
    inside, outside = results[spec]["inside"], results[spec]["outside"]
    assert inside.keys() == outside.keys()
    for key, value in outside.items():
        assert torch.equal(inside[key], value), key


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.endswith(("resumed", "inside"))])
def test_average_starts_as_a_copy_of_its_source(results: dict, spec: str) -> None:
    """As ``AveragedModel``'s deep copy: the average's own initial weights (another seed) are replaced at setup."""
    generator = reference(steps=0)
    for key, value in results[spec]["start"].items():
        if key != "generator_ema.calls":
            expected = generator[key.replace("generator_ema.", "generator.")]
            assert torch.equal(value, expected), f"{spec} {key} is not the generator's initial weight"


@pytest.mark.parametrize("spec", ["2:0", "3p0:3p0"])
def test_export_writes_the_average(results: dict, spec: str, tmp_path: Path) -> None:
    """The last checkpoint holds the average (weights only, whole) and ``export`` writes it as a plain state dict."""
    export(results[spec]["checkpoint"], tmp_path)
    exported = torch.load(tmp_path / "generator_ema.pt")
    expected = {k.removeprefix("generator_ema."): v for k, v in reference().items() if k.startswith("generator_ema.")}
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        assert (exported[key] - value).abs().max().item() <= TOLERANCE, key
