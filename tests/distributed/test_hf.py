"""Hugging Face models as engines (2 ranks): GPT-2 with tied embeddings, LoRA adapters, gradient checkpointing.

Skipped without ``transformers`` and ``peft`` (installed by the project's ``dev`` extra).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import GPT2LMHeadModel  # noqa: E402

from lightning_multids.checkpoint import export  # noqa: E402
from tests.distributed import run_hf  # noqa: E402
from tests.distributed.harness import run_ranks  # noqa: E402

STEPS = 3
SPECS = ["3", "2+lora", "3+lora+ckpt", "2+ckpt"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("hf") / "results.pt"
    run_ranks(Path(run_hf.__file__), str(out), str(STEPS), *SPECS, timeout=600)
    return torch.load(out, weights_only=False)


def reference(spec: str, global_batch: int = 8) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Plain PyTorch in one process on the global batches: the trained actor and its initial state."""
    actor, ref = run_hf.make_models(lora="lora" in spec, checkpointing="ckpt" in spec)
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    optimizer = torch.optim.SGD(run_hf.trainable(actor), lr=0.5)
    tokens = run_hf.make_tokens(STEPS)
    for step in range(STEPS):
        run_hf.loss_of(actor, ref, tokens[step * global_batch : (step + 1) * global_batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return actor, initial


@pytest.mark.parametrize("spec", SPECS)
def test_actor_trains_as_plain_pytorch_beside_a_frozen_zero3_reference(results: dict, spec: str) -> None:
    """Weights equal (≤ 1e-5), embeddings still tied, and only the trainable ones moved (LoRA: the adapters)."""
    actor, initial = reference(spec)
    weights = results[spec]["weights"]
    moved = 0.0
    for key, value in actor.state_dict().items():
        diff = (weights[f"actor.{key}"] - value).abs().max().item()
        assert diff <= 1e-5, f"{spec} {key}: max abs difference {diff:.2e} from plain PyTorch"
        change = (value - initial[key]).abs().max().item()
        if "lora" in spec and "lora_" not in key:
            assert change == 0.0, f"{spec} {key}: a frozen base weight moved"
        moved = max(moved, change)
    assert moved >= 1e-2, f"{spec}: the reference barely trained ({moved:.1e})"
    assert results[spec]["tied"], "lm_head and the token embedding must stay one parameter"
    head = next(k for k in weights if k.endswith("lm_head.weight") and k.startswith("actor."))
    assert torch.equal(weights[head], weights[head.replace("lm_head", "transformer.wte")])


def test_lora_engine_holds_optimizer_state_for_the_adapters_alone(results: dict) -> None:
    adapters = results["2+lora"]["trainable"]
    assert adapters == 2 * 4 * (32 + 96)  # 2 layers, each A (4 x 32) and B (96 x 4) on c_attn
    assert results["2+lora"]["optimizer_numel"] == adapters // 2, "ZeRO-2: each of 2 ranks holds half the adapters"


@pytest.mark.parametrize("spec", SPECS)
def test_generate_inside_gathered_matches_plain_pytorch(results: dict, spec: str) -> None:
    actor, _ = reference(spec)
    with torch.no_grad():
        expected = actor.generate(run_hf.PROMPT, max_new_tokens=5, do_sample=False)
    assert torch.equal(results[spec]["generated"], expected)


@pytest.mark.parametrize("spec", ["3", "2+lora"])
def test_export_loads_with_from_pretrained_and_merges_lora(results: dict, spec: str, tmp_path: Path) -> None:
    """``export`` writes the actor's state dict; it loads into the Hugging Face model (PEFT's for LoRA, then
    merged into plain GPT-2), which ``save_pretrained``/``from_pretrained`` round-trips to the same logits."""
    export(results[spec]["checkpoint"], tmp_path / "exported")
    state = torch.load(tmp_path / "exported" / "actor.pt")
    model, _ = run_hf.make_models(lora="lora" in spec, checkpointing=False)
    model.load_state_dict(state)
    if "lora" in spec:
        model = model.merge_and_unload()
    model.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert_trained_logits(loaded, spec, tied=loaded)


@pytest.mark.parametrize(("spec", "merge"), [("3", False), ("2+lora", False), ("2+lora", True)])
def test_export_format_hf_writes_what_from_pretrained_loads(
    results: dict, spec: str, merge: bool, tmp_path: Path
) -> None:
    """``lightning-multids export CKPT OUT --format hf [--merge-lora]``: a ``save_pretrained`` folder for the actor.

    GPT-2 loads with ``from_pretrained`` (its embeddings still tied); a LoRA actor's folder is its adapter, loaded
    onto the base model with PEFT, or with ``--merge-lora`` a plain GPT-2. Each gives the trained actor's logits.
    """
    from lightning_multids.cli import main

    main(["export", results[spec]["checkpoint"], str(tmp_path), "--format", "hf", *(["--merge-lora"] if merge else [])])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor", "plain.pt"]  # the frozen reference is not saved
    if "lora" in spec and not merge:
        from peft import PeftModel

        base, _ = run_hf.make_models(lora=False, checkpointing=False)  # LoRA leaves the base's weights as they were
        loaded = PeftModel.from_pretrained(base, tmp_path / "actor")
        assert_trained_logits(loaded, spec, tied=loaded.get_base_model())
    else:
        loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "actor")
        assert_trained_logits(loaded, spec, tied=loaded)


def assert_trained_logits(loaded: torch.nn.Module, spec: str, tied: GPT2LMHeadModel) -> None:
    """``loaded`` gives the logits of plain PyTorch's trained actor, and ``tied`` (its GPT-2) ties its embeddings."""
    trained, _ = reference(spec)
    with torch.no_grad():
        expected = trained(input_ids=run_hf.PROMPT).logits
        logits = loaded(input_ids=run_hf.PROMPT).logits
    assert (logits - expected).abs().max().item() <= 1e-4
    assert tied.lm_head.weight is tied.transformer.wte.weight
