"""One optimizer over several submodules (taming-transformers' VQGAN, BYOL): one engine over exactly those parts.

A small autoencoder-GAN: ``encoder`` and ``decoder`` trained by one Adam, ``disc`` by its own, on 2 ranks against
plain PyTorch on the global batch, at ZeRO 0, 2 and 3 and mixed (the joined engine at 2 through its
``engine_configs`` entry, keyed by its first part, ``disc`` at 3). The LightningModule's layout stays as written:
``consolidated_state_dict`` has its own keys, a checkpoint's ``consolidated_state_dicts`` one dict per submodule, its
``lightning`` export loads with ``load_from_checkpoint``; a fit saved after its first epoch resumes to the weights of
an unbroken one. (The refusal of an ``engine_configs`` entry for the second part is in ``test_errors``.)
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.checkpoint import consolidated_state_dicts, export
from tests.distributed.common import AtFitEnd, cpu_trainer, global_batch, regression_data, sharded_loader
from tests.distributed.harness import on_ranks

STEPS, PER_RANK, EPOCHS = 2, 4, 2


def make_parts() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(5, 3), nn.Tanh())
    decoder = nn.Sequential(nn.Linear(3, 5))
    disc = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    return encoder, decoder, disc


def optimizers(encoder: nn.Module, decoder: nn.Module, disc: nn.Module) -> list[torch.optim.Optimizer]:
    joined = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=0.05)
    return [joined, torch.optim.Adam(disc.parameters(), lr=0.05)]


def train_step(
    encoder: nn.Module, decoder: nn.Module, disc: nn.Module, batch: torch.Tensor, opt_g: object, opt_d: object, backward
) -> None:
    """The discriminator first, on the reconstruction detached; then the autoencoder, through the discriminator."""
    reconstruction = decoder(encoder(batch))
    opt_d.zero_grad()
    backward(disc(batch).tanh().mean() - disc(reconstruction.detach()).tanh().mean())
    opt_d.step()
    opt_g.zero_grad()
    backward((reconstruction - batch).pow(2).mean() + 0.1 * disc(reconstruction).mean())
    opt_g.step()


class AutoencoderGAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder, self.disc = make_parts()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        train_step(self.encoder, self.decoder, self.disc, batch, opt_g, opt_d, self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return optimizers(self.encoder, self.decoder, self.disc)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


class Validated(AutoencoderGAN):
    """Validated after its fit: the reconstruction error of the trained encoder and decoder, over the ranks."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", (self.decoder(self.encoder(batch)) - batch).pow(2).mean(), sync_dist=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


def validate_after_fit(case: str) -> float:
    """``trainer.validate`` after a fit of ``case`` (no validation inside the fit): what the user reads."""
    options = {"use_distributed_sampler": False, "enable_checkpointing": False, "max_epochs": EPOCHS}
    trainer = cpu_trainer(
        MultiDeepSpeedStrategy(**CASES[case]), check_val_every_n_epoch=EPOCHS + 1, num_sanity_val_steps=0, **options
    )
    module = Validated()
    trainer.fit(module)
    return float(trainer.validate(module, verbose=False)[0]["val/loss"])


CASES = {  # name: strategy arguments
    "zero0": {"stage": 0},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "joined2_disc3": {"stage": 3, "engine_configs": {"encoder": {"zero_optimization": {"stage": 2}}}},
}
RESUMED = ("zero3", "joined2_disc3")


def fit(case: str, epochs: int, folder: str, save: str | None = None, resume: str | None = None) -> dict:
    at_end = AtFitEnd(lambda strategy: (strategy.consolidated_state_dict(), sorted(strategy.engines)))
    options = {"use_distributed_sampler": False, "enable_checkpointing": False, "max_epochs": epochs}
    trainer = cpu_trainer(MultiDeepSpeedStrategy(**CASES[case]), callbacks=[at_end], **options)
    trainer.fit(AutoencoderGAN(), ckpt_path=f"{folder}/{resume}" if resume else None)
    if save:
        trainer.save_checkpoint(f"{folder}/{save}")
    weights, engines = at_end.value
    return {"weights": {key: value.detach().clone() for key, value in weights.items()}, "engines": engines}


def run(folder: str) -> dict:
    results = {case: fit(case, EPOCHS, folder) for case in CASES}
    results["validated_zero3"] = validate_after_fit("zero3")
    for case in RESUMED:
        results[f"{case}_first"] = fit(case, 1, folder, save=f"{case}.ckpt")
        results[f"{case}_resumed"] = fit(case, EPOCHS, folder, resume=f"{case}.ckpt")
    return results


def reference(epochs: int) -> dict[str, torch.Tensor]:
    encoder, decoder, disc = make_parts()
    opt_g, opt_d = optimizers(encoder, decoder, disc)
    data = regression_data(STEPS, PER_RANK)
    for _ in range(epochs):
        for step in range(STEPS):
            train_step(encoder, decoder, disc, global_batch(data, step, PER_RANK), opt_g, opt_d, torch.Tensor.backward)
    parts = {"encoder": encoder, "decoder": decoder, "disc": disc}
    return {f"{name}.{key}": value for name, part in parts.items() for key, value in part.state_dict().items()}


def reference_validation() -> float:
    """The mean reconstruction error over the global batches, after the unbroken fit."""
    encoder, decoder, _ = make_parts()
    whole = reference(EPOCHS)
    encoder.load_state_dict({k.split(".", 1)[1]: v for k, v in whole.items() if k.startswith("encoder.")})
    decoder.load_state_dict({k.split(".", 1)[1]: v for k, v in whole.items() if k.startswith("decoder.")})
    data = regression_data(STEPS, PER_RANK)
    batches = [global_batch(data, step, PER_RANK) for step in range(STEPS)]
    with torch.no_grad():
        losses = [(decoder(encoder(batch)) - batch).pow(2).mean() for batch in batches]
    return float(torch.stack(losses).mean())


def assert_weights(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert list(found) == list(expected), what
    for key, value in expected.items():
        torch.testing.assert_close(found[key].float(), value, rtol=1e-5, atol=1e-5, msg=f"{what}: {key}")


def test_one_optimizer_over_two_submodules_trains_saves_resumes_and_exports_as_written(tmp_path: Path) -> None:
    results = on_ranks(run, str(tmp_path))[0]
    whole, first = reference(EPOCHS), reference(1)
    keys = list(AutoencoderGAN().state_dict())
    for case in CASES:
        assert results[case]["engines"] == ["disc", "encoder"], case
        assert list(results[case]["weights"]) == keys, case
        assert_weights(results[case]["weights"], whole, case)
    assert results["validated_zero3"] == pytest.approx(reference_validation(), rel=1e-5), "validate after ZeRO-3"
    for case in RESUMED:
        assert_weights(results[f"{case}_first"]["weights"], first, f"{case} after 1 epoch")
        assert_weights(results[f"{case}_resumed"]["weights"], whole, f"{case} resumed")
        states = consolidated_state_dicts(tmp_path / f"{case}.ckpt")
        assert sorted(states) == ["decoder", "disc", "encoder", "plain"], case
        per_part = {f"{name}.{key}": v for name in ("encoder", "decoder", "disc") for key, v in states[name].items()}
        assert_weights(per_part, first, f"{case}: consolidated_state_dicts")
        (exported,) = export(tmp_path / f"{case}.ckpt", tmp_path / f"{case}_export", format="lightning")
        loaded = AutoencoderGAN.load_from_checkpoint(exported)
        assert_weights(loaded.state_dict(), first, f"{case}: load_from_checkpoint of the export")
