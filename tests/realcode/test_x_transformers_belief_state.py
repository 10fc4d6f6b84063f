"""x-transformers==2.31.10: a belief-state transformer, a forward and a backward decoder trained together.

Follows the package's ``train_belief_state.py`` (github.com/lucidrains/x-transformers) with
``FORWARD_BACKWARD_SAME_MODEL = False``: two ``TransformerWrapper`` decoders with rotary positions (the backward one
shallower) in the package's ``BeliefStateWrapper(forward_decoder=..., backward_decoder=...)``, which adds a suffix
token, a text head for both directions and a buffer of loss weights, and hands the two decoders' embeddings to the
head through its ``detach_multiple`` autograd function (each decoder's backward is run once, from the head's
gradients); ``Adam(model.parameters())``; the script's loop: ``(loss / GRADIENT_ACCUMULATE_EVERY).backward()`` for
each batch, then ``clip_grad_norm_(model.parameters(), 0.5)``, ``optim.step()``, ``optim.zero_grad()``. In Lightning:
manual optimization, Lightning's accumulation pattern (``manual_backward(loss / N)``, the step every N batches),
the clipping as ``self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")``.

At tiny widths: 16 tokens, sequences of 9 (the script: bytes of enwik8, 257), dimension 8, depths 2 and 1 (the
script: 512, 6 and 4), accumulation over 2 batches (the script: 8), its lr (1e-4) raised to 1e-2 so 3 steps move the
weights; the token ids are made with torch. Both decoders are in the wrapper, under the script's one optimizer: one
engine over ``model``, no separate part to give another stage, so this case has no mixed setup. The wrapper
reads the decoders' embeddings only, so their own logit layers get no gradient: ``find_unused_parameters=True``,
which DDP asks for here.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from x_transformers import BeliefStateWrapper, Decoder, TransformerWrapper

from tests.distributed.common import sharded_loader
from tests.realcode.harness import Case, Launched, assert_matches_ddp, setups

STEPS, PER_RANK, TOKENS, SEQ_LEN, GRADIENT_ACCUMULATE_EVERY = 3, 2, 16, 8, 2


def decoder(depth: int) -> TransformerWrapper:
    return TransformerWrapper(
        num_tokens=TOKENS, max_seq_len=SEQ_LEN, attn_layers=Decoder(dim=8, depth=depth, heads=2, rotary_pos_emb=True)
    )


class BeliefState(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = BeliefStateWrapper(forward_decoder=decoder(2), backward_decoder=decoder(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optim = self.optimizers()
        loss = self.model(batch)
        self.manual_backward(loss / GRADIENT_ACCUMULATE_EVERY)
        if (batch_idx + 1) % GRADIENT_ACCUMULATE_EVERY == 0:
            self.clip_gradients(optim, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optim.step()
            optim.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rows = STEPS * GRADIENT_ACCUMULATE_EVERY * PER_RANK * 2
        seqs = torch.randint(TOKENS, (rows, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
        return sharded_loader(self, seqs, batch_size=PER_RANK)


CASE = Case(build=BeliefState, find_unused=True)  # the decoders' own logit layers are unused (embeddings only)


@pytest.mark.parametrize("setup", setups(CASE))
def test_matches_ddp(setup: str, launched: Launched) -> None:
    assert_matches_ddp(launched, setup)
