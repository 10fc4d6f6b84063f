"""x-transformers==2.31.10: DPO of a small GPT against its frozen reference copy, with the package's ``DPO`` wrapper.

Follows ``x_transformers/dpo.py`` at 2.31.10 (github.com/lucidrains/x-transformers; the README only cites the DPO
paper, so the class's own interface is the documentation): ``DPO(gpt, beta=0.1, pad_id=...)`` around a
``TransformerWrapper(num_tokens, max_seq_len, attn_layers=Decoder(dim, depth, heads))``; the wrapper keeps the
policy as ``policy_model`` and a ``deepcopy`` of it, every parameter frozen, as ``ref_model``; its ``parameters()``
are the policy's, so the optimizer is ``Adam(dpo.parameters())``; ``loss = dpo(preferred_seq, unpreferred_seq,
prompt_mask=prompt_mask)`` then backward, here in Lightning's automatic optimization. The reference is scored under
``torch.no_grad()`` in eval mode inside the wrapper's forward. At tiny widths (dim 8, 1 layer, 16 tokens,
sequences of 8 with a prompt of 3 and padding in the completions); preferences are random ids made with torch.

The reference lives inside the wrapper, so the strategy builds one engine over ``dpo`` (the policy trained, the
reference frozen inside it): there is no separate engine to give the reference another stage, so this case has no
mixed setup.

Finding (zero3, refused at setup): DeepSpeed's ZeRO-3 partitioning calls ``module.parameters(recurse=True)`` on the
engine's submodule, and ``DPO.parameters(self)`` takes no argument: it was ``TypeError: DPO.parameters() got an
unexpected keyword argument 'recurse'`` from inside ``deepspeed.initialize``; now the strategy refuses it at setup,
naming the class and ZeRO-0/1/2 as the fix (torch's own ``Module`` methods call ``named_parameters``, so the
override works under DDP and at ZeRO-0/2, where it matches bit for bit).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from x_transformers import Decoder, TransformerWrapper
from x_transformers.dpo import DPO

from tests.distributed.common import sharded_loader
from tests.realcode.harness import Case, Launched, assert_matches_ddp, setups

STEPS, PER_RANK, LENGTH, PROMPT, TOKENS, PAD = 3, 4, 8, 3, 16, 0


class Preference(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        gpt = TransformerWrapper(num_tokens=TOKENS, max_seq_len=LENGTH, attn_layers=Decoder(dim=8, depth=1, heads=2))
        self.dpo = DPO(gpt, beta=0.1, pad_id=PAD)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        preferred_seq, unpreferred_seq = batch.unbind(1)
        prompt_mask = torch.arange(LENGTH, device=batch.device) < PROMPT
        return self.dpo(preferred_seq, unpreferred_seq, prompt_mask=prompt_mask.expand_as(preferred_seq))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dpo.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """Pairs of sequences sharing a prompt, each completion cut short by padding at a random length."""
        generator = torch.Generator().manual_seed(1)
        rows = STEPS * PER_RANK * 2
        pairs = torch.randint(1, TOKENS, (rows, 2, LENGTH), generator=generator)
        pairs[:, 1, :PROMPT] = pairs[:, 0, :PROMPT]
        ends = torch.randint(PROMPT + 2, LENGTH + 1, (rows, 2, 1), generator=generator)
        pairs = pairs.masked_fill(torch.arange(LENGTH) >= ends, PAD)
        return sharded_loader(self, pairs, batch_size=PER_RANK)


CASE = Case(
    build=Preference,
    ci=("zero2", "zero3"),  # zero3 fails at setup: zero2 is what CI compares
    xfail={
        "zero3": "refused at setup: DPO overrides parameters() without `recurse`, which ZeRO-3 calls on every "
        "submodule (the error names the class and ZeRO-0/1/2)",
    },
)


@pytest.mark.parametrize("setup", setups(CASE))
def test_matches_ddp(setup: str, launched: Launched) -> None:
    assert_matches_ddp(launched, setup)
