"""EMA engines (``MultiDeepSpeedStrategy(ema=...)``) against ``torch.optim.swa_utils.AveragedModel``, 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_multids.checkpoint import export
from tests import patterns
from tests.distributed import run_ema
from tests.distributed.harness import run_ranks

DECAY = 0.7  # far from 1, so that an average that skipped, repeated or mis-weighted an update shows
STEPS = 2 * run_ema.BATCHES  # 2 epochs
TOLERANCE = 1e-6
SPECS = ["0:0", "2:0", "3p0:0", "2:3", "2:3p0", "3:3p0", "3p0:3p0", "2:3:resumed", "2:3p0:resumed", "3p0:3p0:resumed"]
SPECS += ["2:3:inside", "3p0:3p0:inside"]  # resumed from a save inside `gathered("generator_ema")`
PLAIN = ["2:3:plain", "3:0:plain"]  # resumed without `ema=`: the average is a plain submodule in the second run


def reference(steps: int = STEPS, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process on the global batches: the GAN, and ``AveragedModel`` after each G step."""
    G, D, _ = run_ema.make_gan()
    opt_g, opt_d = patterns.make_optimizer("adam", G.parameters()), patterns.make_optimizer("adam", D.parameters())
    average = AveragedModel(G, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    data = patterns.make_batches(run_ema.BATCHES, global_batch)
    for step in range(steps):
        batch = data[step % run_ema.BATCHES * global_batch : (step % run_ema.BATCHES + 1) * global_batch]
        patterns.gan_zero_first(G, D, batch, opt_g, opt_d, lambda loss: loss.backward())  # opt_g.step() comes last
        average.update_parameters(G)
    out = {f"generator.{k}": v.detach().clone() for k, v in G.state_dict().items()}
    out.update({f"generator_ema.{k}": v.detach().clone() for k, v in average.module.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ema") / "results.pt"
    run_ranks(Path(run_ema.__file__), str(out), str(DECAY), *SPECS, *PLAIN, timeout=600)
    return torch.load(out)


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
