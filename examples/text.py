"""Text on every machine, and small causal language models for it: the Python standard library's docstrings, as bytes.

The corpus is the docstrings (modules, classes, functions) of the standard library's top-level ``.py`` files,
read with :mod:`ast`: about 0.9 MB of English on Python 3.11, nothing downloaded. Two ways to hold modules out, so
that held-out perplexity is measured on modules the models never saw:

* ``"files"`` (the default): every tenth file in sorted order. It follows the files that this Python's build ships
  (a build with other files splits differently), and a few modules repeat others' docstrings (``_py_abc`` and
  ``abc``, say), so some held-out text is also in the training text (11 of the 512 validation blocks on CPython
  3.11.7).
* ``"names"``: public modules only (no leading underscore, so no such repeats), held out when the CRC-32 of the
  module's name is 0 modulo 10: the same modules on every build that has them.

docs/language-models.md says what each split means for the results. Tokens are UTF-8 bytes (256 of them): no
tokenizer to train or ship, and perplexity is per byte.

The models are GPT-2s built from a config (``transformers``), as small as 2 CPU processes train in minutes.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from functools import cache
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256
"""Byte-level tokens."""
PAD = 0
"""The NUL byte, which no docstring holds: Hugging Face's ``generate`` wants a padding token."""
HELD_OUT_EVERY = 10
Split = Literal["files", "names"]
"""Which modules are held out (the module's docstring)."""


def docstrings(path: Path) -> list[str]:
    """The docstrings of ``path``'s module, classes and functions that are longer than a line's worth."""
    try:
        tree = ast.parse(path.read_bytes())
    except SyntaxError:  # a file of the standard library that only a later Python parses
        return []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    texts = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, nodes))
    return [text for text in texts if text and len(text) > 40]


def check_split(split: str) -> None:
    """Raise ``ValueError`` naming the splits there are, unless ``split`` is one of them."""
    if split not in ("files", "names"):
        raise ValueError(f"Unknown split {split!r}: use 'files' (every tenth file) or 'names' (by module name).")


def held_out_module(index: int, path: Path, split: Split) -> bool | None:
    """Whether file number ``index`` (in sorted order) is held out under ``split``; None where ``split`` drops it."""
    check_split(split)
    if split == "files":
        return index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    if path.stem.startswith("_"):
        return None
    return zlib.crc32(path.stem.encode()) % HELD_OUT_EVERY == 0


@cache
def corpus(split: Split = "files") -> tuple[bytes, bytes]:
    """(training text, held-out text) as UTF-8 bytes, the modules held out as ``split`` says (the module docstring)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[str] = []
    held_out: list[str] = []
    for index, path in enumerate(sorted(root.glob("*.py"))):
        held = held_out_module(index, path, split)
        if held is not None:
            (held_out if held else train).extend(docstrings(path))
    text = "\n\n".join(train).encode(), "\n\n".join(held_out).encode()
    if min(len(part) for part in text) < 10_000:
        raise RuntimeError(
            f"The Python standard library's sources hold too little text under {root} ({len(text[0])} bytes to train "
            f"on, {len(text[1])} held out). These examples read its docstrings: run them with a Python that "
            "ships its .py files (a stripped or zipped standard library has none)."
        )
    return text


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokens (int64) of ``text``."""
    data = text.encode() if isinstance(text, str) else text
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    """The text of byte-level ``tokens`` (invalid UTF-8 shown as a replacement character)."""
    return bytes(tokens.tolist()).decode(errors="replace")


def blocks(data: bytes, length: int) -> torch.Tensor:
    """``data`` cut into consecutive blocks of ``length`` tokens (the remainder dropped): n x length."""
    tokens = encode(data)
    n = len(tokens) // length
    return tokens[: n * length].view(n, length)


def gpt2(layers: int, width: int = 128, heads: int = 4, context: int = 128) -> GPT2LMHeadModel:
    """A byte-level GPT-2 of ``layers`` blocks of ``width``, without dropout (its weights from torch's seed)."""
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    return GPT2LMHeadModel(config)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy of each token of ``tokens`` (B x T) given those before it, from ``logits`` (B x T x V)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class TextDataModule(pl.LightningDataModule):
    """Blocks of the corpus as batches of one tensor (B x ``block_size`` byte tokens).

    Args:
        block_size: tokens per block (the models' context must hold it).
        batch_size: blocks per process and step.
        val_blocks: how many held-out blocks validation reads (the first ones, the same every epoch).
        split: which modules are held out: ``"files"`` (every tenth file) or ``"names"`` (by module name).
    """

    def __init__(self, block_size: int = 64, batch_size: int = 32, val_blocks: int = 512, split: Split = "files"):
        super().__init__()
        check_split(split)  # an unknown split fails here, before the ranks start
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_blocks = val_blocks
        self.split = split

    def setup(self, stage: str) -> None:
        train, held_out = corpus(self.split)
        self.train_set = TensorDataset(blocks(train, self.block_size))
        self.val_set = TensorDataset(blocks(held_out, self.block_size)[: self.val_blocks])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
