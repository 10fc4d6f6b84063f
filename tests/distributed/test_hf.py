"""Hugging Face models as engines (2 ranks): GPT-2 with tied embeddings, LoRA adapters, gradient checkpointing.

The rank code, :func:`fit_all`, trains GPT-2 models (built from a config) as engines for each spec
``ACTOR_STAGE[+lora][+ckpt]``: the actor (tied embeddings) trained at that stage, with LoRA adapters on its
attention (PEFT) and/or gradient checkpointing; the reference, a frozen copy, at ZeRO-3 beside it. Each step: a
language-model loss plus a KL penalty towards the reference (SGD). At the end of fit the actor generates greedily
inside ``strategy.gathered("actor")``. Each rank returns {spec: {"weights", "generated", "tied", "trainable",
"optimizer_numel", "checkpoint"}}.

Skipped without ``transformers`` and ``peft`` (installed by the project's ``dev`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from lightning_multids import MultiDeepSpeedStrategy  # noqa: E402
from lightning_multids.checkpoint import export  # noqa: E402
from tests.distributed.common import cpu_trainer, sharded_loader  # noqa: E402
from tests.distributed.harness import on_ranks  # noqa: E402

STEPS = 3
SPECS = ["3", "2+lora", "3+lora+ckpt", "2+ckpt"]
VOCAB, LENGTH, KL = 64, 12, 0.1
PROMPT = torch.tensor([[1, 2, 3], [4, 5, 6]])


def config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def make_models(lora: bool, checkpointing: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The actor (with LoRA adapters if asked) and the reference, a copy of the actor's initial weights."""
    torch.manual_seed(0)
    actor = GPT2LMHeadModel(config())
    reference = GPT2LMHeadModel(config())
    reference.load_state_dict(actor.state_dict())
    if checkpointing:  # transformers 5's name (its old gradient_checkpointing_enable warns)
        actor.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        adapters = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], init_lora_weights=False)
        actor = get_peft_model(actor, adapters)
    return actor, reference


def make_tokens(steps: int, global_batch: int = 8) -> torch.Tensor:
    return torch.randint(1, VOCAB, (steps * global_batch, LENGTH), generator=torch.Generator().manual_seed(5))


def loss_of(actor: torch.nn.Module, reference: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy plus KL(actor || reference) per token."""
    logits = actor(input_ids=tokens).logits
    with torch.no_grad():
        reference_logits = reference(input_ids=tokens).logits
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    log_p, log_q = logits.log_softmax(-1), reference_logits.log_softmax(-1)
    return lm + KL * (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def trainable(actor: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in actor.parameters() if p.requires_grad]


class HFPolicy(pl.LightningModule):
    def __init__(self, steps: int, lora: bool, checkpointing: bool) -> None:
        super().__init__()
        self.steps = steps
        self.actor, self.reference = make_models(lora, checkpointing)
        self.generated: torch.Tensor | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_of(self.actor, self.reference, batch)  # one trainable engine: automatic optimization

    def on_train_end(self) -> None:
        with self.trainer.strategy.gathered("actor") as actor:
            self.generated = actor.generate(PROMPT, max_new_tokens=5, do_sample=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(trainable(self.actor), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, make_tokens(self.steps))


def fit(spec: str, steps: int, root: Path) -> dict[str, Any]:
    stage, *variants = spec.split("+")
    module = HFPolicy(steps, lora="lora" in variants, checkpointing="ckpt" in variants)
    strategy = MultiDeepSpeedStrategy(
        engine_configs={
            "actor": {"zero_optimization": {"stage": int(stage)}},
            "reference": {"zero_optimization": {"stage": 3}},
        }
    )
    read = {}

    class AtEnd(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            engine = strategy.engines["actor"]
            read["optimizer_numel"] = sum(t.numel() for group in engine.optimizer.param_groups for t in group["params"])

    trainer = cpu_trainer(
        strategy,
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True), AtEnd()],
        default_root_dir=root,
    )
    trainer.fit(module)
    weights = {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()}
    base = module.actor.get_base_model() if hasattr(module.actor, "get_base_model") else module.actor
    return {
        "weights": weights,
        "generated": module.generated,
        "tied": base.lm_head.weight is base.transformer.wte.weight,
        "trainable": sum(p.numel() for p in trainable(module.actor)),
        "checkpoint": str(root / "last.ckpt"),
        **read,
    }


def fit_all(steps: int, specs: list[str], root: Path) -> dict[str, dict[str, Any]]:
    """One rank: fit each spec (its checkpoints under ``root/SPEC``); rank 0's result is what the tests read."""
    return {spec: fit(spec, steps, root / spec) for spec in specs}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return on_ranks(fit_all, STEPS, SPECS, tmp_path_factory.mktemp("hf"), timeout=600)[0]


def reference(spec: str, global_batch: int = 8) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Plain PyTorch in one process on the global batches: the trained actor and its initial state."""
    actor, ref = make_models(lora="lora" in spec, checkpointing="ckpt" in spec)
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    optimizer = torch.optim.SGD(trainable(actor), lr=0.5)
    tokens = make_tokens(STEPS)
    for step in range(STEPS):
        loss_of(actor, ref, tokens[step * global_batch : (step + 1) * global_batch]).backward()
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
        expected = actor.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert torch.equal(results[spec]["generated"], expected)


@pytest.mark.parametrize("spec", ["3", "2+lora"])
def test_export_loads_with_from_pretrained_and_merges_lora(results: dict, spec: str, tmp_path: Path) -> None:
    """``export`` writes the actor's state dict; it loads into the Hugging Face model (PEFT's for LoRA, then
    merged into plain GPT-2), which ``save_pretrained``/``from_pretrained`` round-trips to the same logits."""
    export(results[spec]["checkpoint"], tmp_path / "exported")
    state = torch.load(tmp_path / "exported" / "actor.pt")
    model, _ = make_models(lora="lora" in spec, checkpointing=False)
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

        base, _ = make_models(lora=False, checkpointing=False)  # LoRA leaves the base's weights as they were
        loaded = PeftModel.from_pretrained(base, tmp_path / "actor")
        assert_trained_logits(loaded, spec, tied=loaded.get_base_model())
    else:
        loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "actor")
        assert_trained_logits(loaded, spec, tied=loaded)


def assert_trained_logits(loaded: torch.nn.Module, spec: str, tied: GPT2LMHeadModel) -> None:
    """``loaded`` gives the logits of plain PyTorch's trained actor, and ``tied`` (its GPT-2) ties its embeddings."""
    trained, _ = reference(spec)
    with torch.no_grad():
        expected = trained(input_ids=PROMPT).logits
        logits = loaded(input_ids=PROMPT).logits
    assert (logits - expected).abs().max().item() <= 1e-4
    assert tied.lm_head.weight is tied.transformer.wte.weight
