"""Per-rank script: Hugging Face GPT-2 models (built from a config) as engines: a trained actor, a frozen reference.

Usage: run_hf.py OUT STEPS SPEC [SPEC ...], each SPEC ``ACTOR_STAGE[+lora][+ckpt]``: the actor (tied embeddings)
trained at that stage, with LoRA adapters on its attention (PEFT) and/or gradient checkpointing; the reference, a
frozen copy, at ZeRO-3 beside it. Each step: a language-model loss plus a KL penalty towards the reference (SGD).
At the end of fit the actor generates greedily inside ``strategy.gathered("actor")``. Writes OUT on rank 0:
{spec: {"weights", "generated", "tied", "trainable", "optimizer_numel", "checkpoint"}}.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")
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


def main() -> None:
    out, steps, *specs = sys.argv[1:]
    results = {spec: fit(spec, int(steps), Path(out).parent / spec) for spec in specs}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
