"""Tokens per second of autoregressive generation by a ZeRO-3 actor: per-layer gathering, ``gathered``, whole.

    torchrun --nproc-per-node N benchmarks/generation.py [--rounds 6] [--tokens 32]

One LightningModule holds an actor (a decoder-only transformer of ``Linear`` layers, greedy decoding without a
KV cache: each new token runs the model over the whole prefix) trained at ZeRO-3 with DeepSpeed's own ZeRO-3
settings, and ``whole``, a copy of it in a stage-0 frozen engine. When training starts, each round times, in
rotating order:

* **layered**: ``actor.generate(...)`` as ZeRO-3 runs it, each layer gathered before its forward and released
  after it, once per token;
* **gathered**: the same inside ``strategy.gathered("actor")``: gathered once, partitioned after;
* **whole**: ``whole.generate(...)``, the same model unpartitioned: the baseline.

Tokens per second count every rank's new tokens. Per round, the time ratios layered/whole and gathered/whole;
the table gives their median and range over the rounds. Every mode must produce the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import BARE, synchronize
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy

SIZES = {  # width, layers, vocabulary, batch per process, prompt length
    "cpu": {"width": 256, "layers": 4, "vocab": 512, "batch": 8, "prompt": 8},
    "gpu": {"width": 1024, "layers": 12, "vocab": 8192, "batch": 32, "prompt": 16},
}
MODES = ("layered", "gathered", "whole")


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each layer a module called as one."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    """A decoder-only transformer language model (learned positions, untied head)."""

    def __init__(self, width: int, layers: int, vocab: int, context: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, width // 64) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def generate(self, prompts: torch.Tensor, tokens: int) -> torch.Tensor:
        """Greedy continuation of ``prompts`` (B x P) by ``tokens`` tokens."""
        sequences = prompts
        for _ in range(tokens):
            next_token = self(sequences)[:, -1].argmax(-1, keepdim=True)
            sequences = torch.cat([sequences, next_token], dim=1)
        return sequences


class Bench(pl.LightningModule):
    def __init__(self, size: dict[str, int], rounds: int, tokens: int) -> None:
        super().__init__()
        self.automatic_optimization = False  # nothing is trained: the timing runs in on_train_start
        self.size, self.rounds, self.tokens = size, rounds, tokens
        self.actor = Decoder(size["width"], size["layers"], size["vocab"])
        self.whole = copy.deepcopy(self.actor)
        self.times: dict[str, list[float]] = {mode: [] for mode in MODES}

    def on_train_start(self) -> None:
        generator = torch.Generator().manual_seed(self.global_rank)
        prompts = torch.randint(self.size["vocab"], (self.size["batch"], self.size["prompt"]), generator=generator)
        prompts = prompts.to(self.device)
        outputs = {}
        for index in range(self.rounds + 1):  # round 0 warms up
            for mode in MODES[index % 3 :] + MODES[: index % 3]:
                torch.distributed.barrier()
                synchronize()
                start = time.perf_counter()
                outputs[mode] = self.generate(mode, prompts)
                synchronize()
                if index:
                    self.times[mode].append(time.perf_counter() - start)
        for mode in MODES:
            assert torch.equal(outputs[mode], outputs["whole"]), f"{mode} generated other tokens than whole"

    def generate(self, mode: str, prompts: torch.Tensor) -> torch.Tensor:
        if mode == "gathered":
            with self.trainer.strategy.gathered("actor") as actor:
                return actor.generate(prompts, self.tokens)
        with torch.no_grad():
            return (self.actor if mode == "layered" else self.whole).generate(prompts, self.tokens)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.actor.parameters(), lr=1e-4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    gpu = torch.cuda.is_available()
    size = SIZES["gpu" if gpu else "cpu"]
    module = Bench(size, args.rounds, args.tokens)
    strategy = MultiDeepSpeedStrategy(
        engine_configs={"actor": {"zero_optimization": {"stage": 3}}, "whole": {"zero_optimization": {"stage": 0}}}
    )
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_epochs=1,
        **BARE,
    )
    trainer.fit(module)
    report(args, size, module)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # before the interpreter exits: gloo aborts a process left with one


def report(args: argparse.Namespace, size: dict[str, int], module: Bench) -> None:
    world = torch.distributed.get_world_size()
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, module.times)
    if torch.distributed.get_rank() != 0:
        return
    slowest = {mode: [max(rank[mode][i] for rank in gathered) for i in range(args.rounds)] for mode in MODES}
    new_tokens = size["batch"] * args.tokens * world
    params = sum(p.numel() for p in module.whole.parameters())
    print(f"actor: {params / 1e6:.1f} M parameters, {size}, {args.tokens} new tokens, {world} processes")
    print("| mode | tokens/s | time / whole (median, min-max) |")
    print("|---|---|---|")
    for mode in MODES:
        ratios = [a / b for a, b in zip(slowest[mode], slowest["whole"], strict=True)]
        rate = new_tokens / statistics.median(slowest[mode])
        print(f"| {mode} | {rate:.0f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
