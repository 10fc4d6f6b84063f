"""The language-model examples' own pieces: the corpus and its split, byte tokens, preference pairs, DPO's terms."""

from __future__ import annotations

import math
import sysconfig
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.dpo import dpo_loss, preference_pairs, response_log_probs  # noqa: E402
from examples.lm_distill import STUDENT_FIRST, checkpoint_weights  # noqa: E402
from examples.text import TextDataModule, blocks, corpus, decode, encode, held_out_module  # noqa: E402


def test_the_corpus_is_english_and_its_held_out_part_is_apart() -> None:
    train, held = corpus()
    assert len(train) > 200_000 and len(held) > 20_000, (len(train), len(held))
    paragraphs = set(held.split(b"\n\n"))
    shared = [p for p in train.split(b"\n\n") if len(p) > 200 and p in paragraphs]
    assert len(shared) < 0.01 * len(paragraphs), f"{len(shared)} long paragraphs are in both parts"


def test_the_split_by_name_holds_out_public_modules_by_the_crc_of_their_name() -> None:
    root = Path("/lib") / "x"
    assert held_out_module(0, root / "_py_abc.py", "names") is None  # private modules are left out
    assert held_out_module(0, root / "abc.py", "names") is (zlib.crc32(b"abc") % 10 == 0)
    assert held_out_module(9, root / "abc.py", "files") and not held_out_module(8, root / "abc.py", "files")
    train, held = corpus("names")
    assert len(train) > 200_000 and len(held) > 20_000 and (train, held) != corpus("files")
    with pytest.raises(ValueError, match="Unknown split 'modules': use 'files'"):
        TextDataModule(split="modules")  # type: ignore[arg-type]


def test_bytes_round_trip_and_blocks_drop_the_remainder() -> None:
    text = "Return the café."
    assert decode(encode(text)) == text
    assert encode(text).max() < 256
    cut = blocks(text.encode(), 5)
    assert cut.shape == (len(text.encode()) // 5, 5)
    assert decode(cut.flatten()) == text.encode()[: cut.numel()].decode(errors="replace")


def test_a_rejected_response_is_another_blocks_continuation_after_the_same_prompt() -> None:
    chosen, rejected = preference_pairs(corpus()[1][:4_000], prompt=12, response=8, seed=0)
    assert chosen.shape == rejected.shape and len(chosen) > 0.95 * (4_000 // 20)
    assert torch.equal(chosen[:, :12], rejected[:, :12])
    assert not (chosen[:, 12:] == rejected[:, 12:]).all(1).any()  # never the block's own
    responses = {tuple(row) for row in chosen[:, 12:].tolist()}
    assert all(tuple(row) in responses for row in rejected[:, 12:].tolist())  # each another block's continuation
    assert len({tuple(row) for row in rejected[:, 12:].tolist()}) > 0.95 * len(rejected)  # each used about once
    with pytest.raises(ValueError, match="Unknown rejected='reversed': use 'other'"):
        preference_pairs(corpus()[1][:4_000], prompt=12, response=8, seed=0, rejected="reversed")  # type: ignore[arg-type]


def test_a_shuffled_rejected_response_is_the_chosen_one_shuffled_after_the_same_prompt() -> None:
    chosen, rejected = preference_pairs(corpus()[1][:4_000], prompt=12, response=8, seed=0, rejected="shuffled")
    assert chosen.shape == rejected.shape == (4_000 // 20, 20)
    assert torch.equal(chosen[:, :12], rejected[:, :12])
    assert torch.equal(chosen[:, 12:].sort(1).values, rejected[:, 12:].sort(1).values)
    assert (chosen[:, 12:] != rejected[:, 12:]).any(1).float().mean() > 0.9


def test_response_log_probs_sum_the_response_tokens_given_what_precedes_them() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 7)
    model = lambda input_ids: SimpleNamespace(logits=logits)  # noqa: E731
    sequence = torch.tensor([[1, 2, 3, 4, 5]])
    log_p = logits.log_softmax(-1)
    expected = log_p[0, 2, 4] + log_p[0, 3, 5]  # tokens 3 and 4 (values 4, 5), each from the position before
    assert response_log_probs(model, sequence, start=3).item() == pytest.approx(expected.item())


def test_dpo_starts_at_log_2_and_rewards_a_policy_that_prefers_the_chosen() -> None:
    same = torch.tensor([-3.0, -5.0, -4.0, -6.0])  # 2 pairs: chosen, chosen, rejected, rejected
    loss, margins = dpo_loss(same, same, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2)) and margins.tolist() == [0.0, 0.0]
    policy = same + torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, margins = dpo_loss(policy, same, beta=0.5)
    assert margins.tolist() == [1.0, 1.0]
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))))


def test_a_missing_checkpoint_says_which_run_writes_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist\. Distill the student first: .*configs/lm_distill"):
        checkpoint_weights(str(tmp_path / "none.ckpt"), "student", STUDENT_FIRST)


def test_a_standard_library_without_sources_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    corpus.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"too little text under .*run them with a Python that ships its \.py"):
            corpus()
    finally:
        corpus.cache_clear()
