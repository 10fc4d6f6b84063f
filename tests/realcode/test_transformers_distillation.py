"""transformers==5.23.0: a causal-LM distillation, a frozen GPT-2 teacher into a smaller GPT-2 student.

Follows Hugging Face's task guide "Knowledge Distillation for Computer Vision"
(huggingface.co/docs/transformers/tasks/knowledge_distillation_for_image_classification), its ``ImageDistilTrainer``
loss, on a causal LM's logits: the teacher in eval mode under ``torch.no_grad()``,
``KLDivLoss(reduction="batchmean")(log_softmax(student / T), softmax(teacher / T)) * T**2`` mixed with the student's
own loss (``labels=input_ids``, the model's shifted cross-entropy) as ``(1 - lambda) * student + lambda * KL``, one
AdamW over the student; here per token (the logits flattened to ``(tokens, vocab)``) and in Lightning's automatic
optimization. Both models are ``GPT2LMHeadModel`` built from a tiny ``GPT2Config`` (nothing downloaded; the head tied
to the token embedding, dropout at its default 0.1), the teacher frozen. Tokens are random ids made with torch.
Setups: the teacher a frozen engine at each stage, and mixed: the teacher at ZeRO-3, the student at ZeRO-2.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from tests.distributed.common import sharded_loader
from tests.realcode.harness import Case, Launched, assert_matches_ddp, setups

STEPS, PER_RANK, LENGTH, VOCAB = 3, 2, 8, 32
TEMPERATURE, LAMBDA = 5.0, 0.5  # the guide's


def gpt2(width: int, layers: int) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=width, n_layer=layers, n_head=2)
    return GPT2LMHeadModel(config)


class Distillation(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student = gpt2(16, 2), gpt2(8, 1)
        self.teacher.eval()
        self.teacher.requires_grad_(False)
        self.loss_function = nn.KLDivLoss(reduction="batchmean")

    def training_step(self, input_ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        student_output = self.student(input_ids=input_ids, labels=input_ids)
        with torch.no_grad():
            teacher_output = self.teacher(input_ids=input_ids)
        soft_teacher = nn.functional.softmax(teacher_output.logits.flatten(0, 1) / TEMPERATURE, dim=-1)
        soft_student = nn.functional.log_softmax(student_output.logits.flatten(0, 1) / TEMPERATURE, dim=-1)
        distillation_loss = self.loss_function(soft_student, soft_teacher) * TEMPERATURE**2
        return (1.0 - LAMBDA) * student_output.loss + LAMBDA * distillation_loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        tokens = torch.randint(VOCAB, (STEPS * PER_RANK * 2, LENGTH), generator=torch.Generator().manual_seed(1))
        return sharded_loader(self, tokens, batch_size=PER_RANK)


CASE = Case(build=Distillation, frozen=("teacher",), mixed={"teacher": 3, "student": 2})


@pytest.mark.parametrize("setup", setups(CASE))
def test_matches_ddp(setup: str, launched: Launched) -> None:
    assert_matches_ddp(launched, setup)
