"""Preference tuning against a frozen reference: DPO of the distilled student, with LoRA adapters.

Run after the two distillation configs (``configs/lm_distill_teacher.yaml``, ``configs/lm_distill.yaml``)::

    lightning-multids fit --config configs/dpo.yaml

Direct Preference Optimization (Rafailov et al., 2023) on pairs built from the standard library's docstrings
(:mod:`examples.text`): a prompt of text, its true continuation (preferred) and the continuation of another place in
the text (rejected: real text that does not follow the prompt). The policy starts from the distilled student's
weights with LoRA adapters on its attention and feed-forward projections (PEFT; only the adapters train); the
reference is the same weights, frozen, partitioned at ZeRO-3 (with ``offload_param``: its partitions in host
memory). Two engines, one optimizer: Lightning's automatic optimization. Training and validation log the loss, the
reward margin ``beta * (log-ratio of the chosen - log-ratio of the rejected)`` and the accuracy (the share of pairs
whose margin is positive); validation also logs how often the policy, and the reference, finds the true continuation
more likely than the other (``prefers``).
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.lm_distill import (
    STUDENT_FIRST,
    checkpoint_weights,
    continuations,
    log_text,
    require_checkpoint,
    with_lora,
)
from examples.text import Split, blocks, check_split, corpus, gpt2

Rejected = Literal["other", "shuffled"]
"""How a pair's rejected response is made (:func:`preference_pairs`)."""


def preference_pairs(
    data: bytes, prompt: int, response: int, seed: int, rejected: Rejected = "other"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected), each n x (prompt + response) tokens: after the same prompt, its own continuation and another.

    The text is cut into blocks of ``prompt + response`` bytes; a block is a prompt and its true continuation. The
    rejected response is, with ``"other"``, the continuation of another block (a random one, never the block
    itself): real text that does not follow the prompt; with ``"shuffled"``, the true continuation's bytes in a
    random order (easy to tell from text). A pair whose two responses are the same is left out.
    """
    chosen = blocks(data, prompt + response)
    generator = torch.Generator().manual_seed(seed)
    if rejected == "other":
        order = torch.randperm(len(chosen), generator=generator)
        others = torch.empty_like(order)
        others[order] = order.roll(1)  # each block takes the next one's in a random cycle: never its own
        responses = chosen[others, prompt:]
    elif rejected == "shuffled":
        order = torch.stack([torch.randperm(response, generator=generator) for _ in range(len(chosen))])
        responses = chosen[:, prompt:].gather(1, order)
    else:
        raise ValueError(f"Unknown rejected={rejected!r}: use 'other' (another block's continuation) or 'shuffled'.")
    rejected_pairs = chosen.clone()
    rejected_pairs[:, prompt:] = responses
    differ = (chosen != rejected_pairs).any(1)
    return chosen[differ], rejected_pairs[differ]


def response_log_probs(model: torch.nn.Module, sequences: torch.Tensor, start: int) -> torch.Tensor:
    """The log-probability (B) of each sequence's tokens from ``start`` on, given the tokens before them."""
    logits = model(input_ids=sequences).logits[:, start - 1 : -1]
    return logits.log_softmax(-1).gather(-1, sequences[:, start:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's loss and the reward margins (B), from log-probabilities (2B: the chosen, then the rejected)."""
    chosen, rejected = (policy - reference).chunk(2)
    margins = beta * (chosen - rejected)
    return -F.logsigmoid(margins).mean(), margins


class DPO(pl.LightningModule):
    """A LoRA policy trained by DPO against a frozen reference of the same starting weights.

    Args:
        student_checkpoint: a checkpoint directory of ``configs/lm_distill.yaml``'s run; the policy and the
            reference start from its engine ``engine``. Without one, both start from the same random weights.
        engine: the checkpoint's engine to start from (``student``, or ``alone`` for the control).
        layers: the student's transformer blocks, as in that run.
        width: its embedding width.
        heads: its attention heads.
        prompt: bytes of each pair's prompt.
        lora_rank: the adapters' rank (0: the whole policy trains).
        beta: DPO's inverse temperature.
        lr: AdamW's learning rate.
        generate: bytes each generated line adds to its prompt.
    """

    def __init__(
        self,
        student_checkpoint: str | None = None,
        engine: str = "student",
        layers: int = 2,
        width: int = 128,
        heads: int = 4,
        prompt: int = 48,
        lora_rank: int = 8,
        beta: float = 0.1,
        lr: float = 1e-3,
        generate: int = 48,
    ) -> None:
        super().__init__()
        require_checkpoint(student_checkpoint, STUDENT_FIRST)
        self.save_hyperparameters()
        self.policy: torch.nn.Module = gpt2(layers, width, heads)
        self.reference = gpt2(layers, width, heads)
        self.run_summary: dict[str, str] = {}
        self.started = False

    def setup(self, stage: str) -> None:
        """Load the starting weights into policy and reference, then add the adapters (before the engines exist).

        Once: a later ``validate`` of the same module keeps what ``fit`` trained (and a ZeRO-3 reference stays
        partitioned after ``fit``, so it cannot load whole weights again).
        """
        if self.started:
            return
        self.started = True
        weights = self.policy.state_dict()
        if self.hparams.student_checkpoint is not None:
            weights = checkpoint_weights(self.hparams.student_checkpoint, self.hparams.engine, STUDENT_FIRST)
            self.policy.load_state_dict(weights)
        self.reference.load_state_dict(weights)
        self.reference.requires_grad_(False)
        if self.hparams.lora_rank:
            self.policy = with_lora(self.policy, self.hparams.lora_rank)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], split: str) -> torch.Tensor:
        """DPO's loss on ``batch`` (chosen, rejected); logs it, the mean reward margin and the accuracy."""
        sequences = torch.cat(batch)
        start = self.hparams.prompt
        policy = response_log_probs(self.policy, sequences, start)
        with torch.no_grad():
            reference = response_log_probs(self.reference, sequences, start)
        loss, margins = dpo_loss(policy, reference, self.hparams.beta)
        metrics = {"loss": loss, "reward_margin": margins.mean(), "accuracy": (margins > 0).float().mean()}
        if split == "val":  # how often each model finds the true continuation the more likely one
            for name, log_probs in (("policy", policy), ("reference", reference)):
                chosen, rejected = log_probs.chunk(2)
                metrics[f"{name}_prefers"] = (chosen > rejected).float().mean()
        self.log_dict({f"{split}/{name}": value for name, value in metrics.items()}, prog_bar=True, sync_dist=True)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.step(batch, "val")

    def on_train_end(self) -> None:
        metrics = self.trainer.callback_metrics
        if "val/accuracy" in metrics:
            accuracy, margin = metrics["val/accuracy"].item(), metrics["val/reward_margin"].item()
            self.run_summary["Held-out preference"] = f"accuracy {accuracy:.3f}, reward margin {margin:.3f}"
            policy, reference = (metrics[f"val/{name}_prefers"].item() for name in ("policy", "reference"))
            self.run_summary["True continuation preferred"] = f"policy {policy:.3f}, reference {reference:.3f}"
        lines = continuations(self, "policy", self.hparams.generate)
        log_text(self, "generated", lines)
        self.run_summary["Generated"] = "  ".join(lines)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.lr, weight_decay=0.0)


class PreferenceDataModule(pl.LightningDataModule):
    """Preference pairs of the corpus (:func:`preference_pairs`) as batches of (chosen, rejected).

    Args:
        prompt: bytes of each prompt (the module's ``prompt`` must be the same).
        response: bytes of each response.
        batch_size: pairs per process and step.
        val_pairs: how many held-out pairs validation reads.
        seed: the seed of the pairing (or the shuffles).
        rejected: ``"other"``: another block's continuation; ``"shuffled"``: the true one's bytes shuffled.
        split: which modules are held out (:class:`~examples.text.TextDataModule`): the student's runs' split.
    """

    def __init__(
        self,
        prompt: int = 48,
        response: int = 16,
        batch_size: int = 16,
        val_pairs: int = 256,
        seed: int = 0,
        rejected: Rejected = "other",
        split: Split = "files",
    ) -> None:
        super().__init__()
        check_split(split)  # an unknown split fails here, before the ranks start
        self.prompt, self.response = prompt, response
        self.batch_size = batch_size
        self.val_pairs = val_pairs
        self.seed = seed
        self.rejected = rejected
        self.split = split

    def setup(self, stage: str) -> None:
        train, held_out = corpus(self.split)
        pairs = preference_pairs(train, self.prompt, self.response, self.seed, self.rejected)
        self.train_set = TensorDataset(*pairs)
        chosen, rejected = preference_pairs(held_out, self.prompt, self.response, self.seed + 1, self.rejected)
        self.val_set = TensorDataset(chosen[: self.val_pairs], rejected[: self.val_pairs])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
