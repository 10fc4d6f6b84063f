"""GradCache under MultiDeepSpeedStrategy: chunked, deferred-sync training equals plain full-batch PyTorch.

The rank code, :func:`fit_cases`, takes GradCache steps at one ZeRO stage for each case: two encoder engines and
one shared encoder engine, each with deferred sync (``no_sync``) and without; plus ``misuse``, which records the
errors of ``opt.step()`` inside ``no_sync`` and of nesting it. Each rank returns the weights and reduction counts
per case. The GPU suite runs it too, on one GPU.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.utilities import ReductionCounter
from lightning_multids.utilities.gradcache import grad_cache, info_nce
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

ROWS, LOCAL_BATCH, CHUNK, STEPS, LR, TEMPERATURE = 64, 16, 4, 2, 0.5, 0.2
QUERY_DIM, DOC_DIM = 12, 8
TOLERANCE = 1e-5
MIN_MOVE = 1e-2


def make_encoder(dim: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 8))


def make_data() -> torch.Tensor:
    """Rows of ``[query (12) | doc (8)]``; a doc is a noisy function of its query, so pairs are learnable."""
    generator = torch.Generator().manual_seed(7)
    queries = torch.randn(ROWS, QUERY_DIM, generator=generator)
    docs = queries[:, :DOC_DIM] * 0.5 + 0.3 * torch.randn(ROWS, DOC_DIM, generator=generator)
    return torch.cat([queries, docs], dim=1)


class GradCacheModule(pl.LightningModule):
    def __init__(self, shared: bool, defer: bool, misuse: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.shared, self.defer, self.misuse = shared, defer, misuse
        self.query_encoder = make_encoder(QUERY_DIM, seed=1)
        if not shared:
            self.doc_encoder = make_encoder(DOC_DIM, seed=2)
        self.counts: list[dict[str, int]] = []
        self.errors: dict[str, str] = {}

    def split(self, batch: torch.Tensor) -> tuple[list[nn.Module], list[torch.Tensor]]:
        queries, docs = batch[:, :QUERY_DIM], batch[:, QUERY_DIM:]
        if self.shared:  # one encoder for both sides: docs padded to the query width
            return [self.query_encoder] * 2, [queries, nn.functional.pad(docs, (0, QUERY_DIM - DOC_DIM))]
        return [self.query_encoder, self.doc_encoder], [queries, docs]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        if self.misuse:
            return self.record_misuse(optimizers, batch)
        encoders, inputs = self.split(batch)
        with ReductionCounter(self.trainer.strategy.engines) as counter:
            for opt in optimizers:
                opt.zero_grad()
            loss = grad_cache(
                self, encoders, inputs, lambda q, d: info_nce(q, d, TEMPERATURE), CHUNK, defer_sync=self.defer
            )
            for opt in optimizers:
                opt.step()
        self.counts.append(counter.counts)
        self.log("loss", loss)

    def record_misuse(self, optimizers: list, batch: torch.Tensor) -> None:
        strategy = self.trainer.strategy
        with strategy.no_sync():
            self.manual_backward(self.query_encoder(batch[:, :QUERY_DIM]).pow(2).mean())
            for name, attempt in (("step", optimizers[0].step), ("nested", lambda: strategy.no_sync().__enter__())):
                try:
                    attempt()
                except Exception as error:  # noqa: BLE001 (recorded for the test to check)
                    self.errors[name] = f"{type(error).__name__}: {error}"
        optimizers[0].step()  # after the block: allowed

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        encoders = [self.query_encoder] + ([] if self.shared else [self.doc_encoder])
        return [torch.optim.SGD(encoder.parameters(), lr=LR) for encoder in encoders]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, make_data()[: 2 * LOCAL_BATCH * STEPS], batch_size=LOCAL_BATCH)


CASES = {  # (shared, defer, misuse)
    "two": (False, True, False),
    "two_every_chunk": (False, False, False),
    "shared": (True, True, False),
    "misuse": (True, True, True),
}


def fit_cases(stage: int) -> dict[str, dict[str, Any]]:
    """One rank: fit every case of :data:`CASES` at ``stage``; the weights, reduction counts and errors of each."""
    results = {}
    for case, (shared, defer, misuse) in CASES.items():
        module = GradCacheModule(shared, defer, misuse)
        strategy = MultiDeepSpeedStrategy(stage=stage)
        trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
        trainer.fit(module)
        state = strategy.consolidated_state_dict()
        results[case] = {"weights": state, "counts": module.counts, "errors": module.errors}
    return results


def reference(shared: bool) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, SGD on the whole global batch (both ranks' rows) per step, no chunks."""
    query_encoder = make_encoder(QUERY_DIM, seed=1)
    doc_encoder = query_encoder if shared else make_encoder(DOC_DIM, seed=2)
    params = list(query_encoder.parameters()) + ([] if shared else list(doc_encoder.parameters()))
    optimizer = torch.optim.SGD(params, lr=LR)
    data = make_data()
    for step in range(STEPS):
        rows = list(range(2 * LOCAL_BATCH * STEPS))
        # rank 0 holds even rows, rank 1 odd rows, each in order: step s is the s-th block of each
        batch = torch.cat([data[rows[rank::2][step * LOCAL_BATCH : (step + 1) * LOCAL_BATCH]] for rank in (0, 1)])
        queries, docs = batch[:, :QUERY_DIM], batch[:, QUERY_DIM:]
        if shared:
            docs = F.pad(docs, (0, QUERY_DIM - DOC_DIM))
        q = F.normalize(query_encoder(queries), dim=-1)
        d = F.normalize(doc_encoder(docs), dim=-1)
        logits = q @ d.T / TEMPERATURE
        labels = torch.arange(len(batch))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names = {"query_encoder": query_encoder} if shared else {"query_encoder": query_encoder, "doc_encoder": doc_encoder}
    return {f"{name}.{k}": v.detach() for name, module in names.items() for k, v in module.state_dict().items()}


def assert_matches(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    initial = {
        **{f"query_encoder.{k}": v for k, v in make_encoder(QUERY_DIM, seed=1).state_dict().items()},
        **{f"doc_encoder.{k}": v for k, v in make_encoder(DOC_DIM, seed=2).state_dict().items()},
    }
    moved = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    assert moved >= MIN_MOVE, f"the reference barely trained ({moved:.1e}): the test would be weak"
    assert set(trained) == set(expected)
    for key, value in expected.items():
        diff = (trained[key].float() - value).abs().max().item()
        assert diff <= TOLERANCE, f"{key}: max abs difference {diff:.2e} from plain PyTorch"


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda s: f"zero{s}")
def results(request: pytest.FixtureRequest) -> tuple[int, dict]:
    return request.param, on_ranks(fit_cases, request.param)[0]


def test_chunked_gradients_equal_full_batch_plain_pytorch(results: tuple[int, dict]) -> None:
    _, cases = results
    assert_matches(cases["two"]["weights"], reference(shared=False))
    assert_matches(cases["two_every_chunk"]["weights"], reference(shared=False))
    assert_matches(cases["shared"]["weights"], reference(shared=True))


def test_one_reduction_per_engine_per_step_with_no_sync(results: tuple[int, dict]) -> None:
    stage, cases = results
    chunks = LOCAL_BATCH // CHUNK
    assert cases["two"]["counts"] == [{"query_encoder": 1, "doc_encoder": 1}] * STEPS
    # The shared encoder runs 2 x chunks backwards per step (one per input chunk).
    assert cases["shared"]["counts"] == [{"query_encoder": 1}] * STEPS
    # Without deferral ZeRO-2/3 reduce in every chunk's backward; stages 0/1 only ever reduce in step().
    every = chunks if stage >= 2 else 1
    assert cases["two_every_chunk"]["counts"] == [{"query_encoder": every, "doc_encoder": every}] * STEPS


def test_step_inside_no_sync_and_nesting_fail_clearly(results: tuple[int, dict]) -> None:
    _, cases = results
    errors = cases["misuse"]["errors"]
    assert "`opt.step()` of engine 'query_encoder' inside `strategy.no_sync(...)`" in errors["step"], errors
    assert "Call `opt.step()` after the `with` block" in errors["step"]
    assert "are inside `strategy.no_sync(...)` already; don't nest them" in errors["nested"], errors
