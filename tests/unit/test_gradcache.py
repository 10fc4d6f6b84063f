"""GradCache in one process: chunked replay gives the gradients of the unchunked computation, dropout included."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_multids._blocks import NO_SYNC, BlockError, inside, no_sync
from lightning_multids._engines import EngineSet
from lightning_multids.utilities.gradcache import grad_cache, info_nce
from tests import fakes


def plain_module() -> Any:
    """Stands in for a LightningModule outside this strategy: ``manual_backward`` is ``loss.backward()``."""
    return SimpleNamespace(manual_backward=lambda loss: loss.backward(), trainer=SimpleNamespace(strategy=object()))


def encoders() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    query = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 4))
    doc = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 4))
    return query, doc


def grads(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters()]


def test_chunked_replay_equals_one_backward_with_the_same_dropout_masks() -> None:
    queries, docs = torch.randn(12, 6), torch.randn(12, 5)
    query, doc = encoders()
    torch.manual_seed(42)
    loss = grad_cache(plain_module(), [query, doc], [queries, docs], info_nce, chunk_size=5)
    after_grad_cache = torch.rand(3)
    chunked = grads(query, doc)

    query, doc = encoders()
    torch.manual_seed(42)  # the same masks: each chunk in the order grad_cache encodes them
    q = torch.cat([query(part) for part in queries.split(5)])
    d = torch.cat([doc(part) for part in docs.split(5)])
    after_forward = torch.rand(3)
    expected = info_nce(q, d)
    expected.backward()

    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    for got, want in zip(chunked, grads(query, doc), strict=True):
        assert (got - want).abs().max().item() <= 1e-6
    assert torch.equal(after_grad_cache, after_forward), "the RNG must continue from after the first pass"


def test_dropout_masks_matter_so_the_replay_check_can_fail() -> None:
    queries, docs = torch.randn(12, 6), torch.randn(12, 5)
    query, doc = encoders()
    torch.manual_seed(42)
    grad_cache(plain_module(), [query, doc], [queries, docs], info_nce, chunk_size=5)
    chunked = grads(query, doc)
    query, doc = encoders()
    torch.manual_seed(7)  # other masks
    info_nce(query(queries), doc(docs)).backward()
    assert max((a - b).abs().max().item() for a, b in zip(chunked, grads(query, doc), strict=True)) > 1e-3


def test_bad_arguments_are_refused() -> None:
    query, doc = encoders()
    with pytest.raises(ValueError, match="2 encoders for 1 inputs: give one per input"):
        grad_cache(plain_module(), [query, doc], [torch.randn(4, 6)], info_nce, chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size=0: use a positive number"):
        grad_cache(plain_module(), [query], [torch.randn(4, 6)], info_nce, chunk_size=0)


def engine_set() -> EngineSet:
    engines = {name: SimpleNamespace(inside_no_sync_ctxt=False) for name in ("query", "doc", "teacher")}
    return fakes.engine_set(engines, [fakes.fake_optimizer("query"), fakes.fake_optimizer("doc")])


def test_no_sync_selects_trainable_engines_and_refuses_the_rest() -> None:
    engines = engine_set()
    assert [record.name for record in engines.for_no_sync(())] == ["query", "doc"]
    assert [record.name for record in engines.for_no_sync(("doc",))] == ["doc"]
    with pytest.raises(ValueError, match=r"\['teacher'\] are frozen: they have no gradients.*Choose from"):
        engines.for_no_sync(("teacher",))
    with pytest.raises(ValueError, match=r"got \['dock'\], which are not trainable engines\. Choose from"):
        engines.for_no_sync(("dock",))
    with inside("no_sync", NO_SYNC, engines.for_no_sync(("doc",))):
        with pytest.raises(BlockError, match=r"\['doc'\] are inside `strategy.no_sync\(...\)` already"):
            no_sync(engines.for_no_sync(())).__enter__()
        assert engines.records["doc"].blocks == [NO_SYNC] and not engines.records["query"].blocks
    assert not engines.records["doc"].blocks
    with pytest.raises(RuntimeError, match="exist only during `Trainer.fit`"):
        EngineSet().for_no_sync(())


def test_every_block_and_gradient_read_outside_fit_is_the_same_runtime_error() -> None:
    """A call at the wrong time is a ``RuntimeError`` whichever call it is; a wrong name during fit a ``ValueError``."""
    from lightning_multids._blocks import _choose, gathered

    calls = {
        "no_sync": lambda: EngineSet().for_no_sync(()),
        "full_gradients('g')": lambda: EngineSet().full_gradients("g"),
        "offloaded('g')": lambda: _choose(("g",), {}),
        "gathered('g')": lambda: gathered("g", {}).__enter__(),
    }
    for call, attempt in calls.items():
        with pytest.raises(RuntimeError, match=rf"^`{re.escape(call)}` needs the engines, which exist only during"):
            attempt()


def test_an_encoder_without_an_engine_is_refused() -> None:
    query, doc = encoders()
    engine = SimpleNamespace(module=query)
    strategy = SimpleNamespace(engines={"query": engine}, no_sync=lambda *names: None)
    module = SimpleNamespace(manual_backward=lambda loss: loss.backward(), trainer=SimpleNamespace(strategy=strategy))
    with pytest.raises(
        ValueError, match=r"encoders \['Sequential'\] are not submodules with an engine.*self.query_encoder"
    ):
        grad_cache(module, [query, doc], [torch.randn(4, 6), torch.randn(4, 5)], info_nce, chunk_size=2)
