"""GradCache under MultiDeepSpeedStrategy: chunked, deferred-sync training equals plain full-batch PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_gradcache as case
from tests.distributed.harness import run_ranks

RUNNER = Path(__file__).with_name("run_gradcache.py")
TOLERANCE = 1e-5
MIN_MOVE = 1e-2


def reference(shared: bool) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, SGD on the whole global batch (both ranks' rows) per step, no chunks."""
    query_encoder = case.make_encoder(case.QUERY_DIM, seed=1)
    doc_encoder = query_encoder if shared else case.make_encoder(case.DOC_DIM, seed=2)
    params = list(query_encoder.parameters()) + ([] if shared else list(doc_encoder.parameters()))
    optimizer = torch.optim.SGD(params, lr=case.LR)
    data = case.make_data()
    for step in range(case.STEPS):
        rows = list(range(2 * case.LOCAL_BATCH * case.STEPS))
        # rank 0 holds even rows, rank 1 odd rows, each in order: step s is the s-th block of each
        batch = torch.cat(
            [data[rows[rank::2][step * case.LOCAL_BATCH : (step + 1) * case.LOCAL_BATCH]] for rank in (0, 1)]
        )
        queries, docs = batch[:, : case.QUERY_DIM], batch[:, case.QUERY_DIM :]
        if shared:
            docs = F.pad(docs, (0, case.QUERY_DIM - case.DOC_DIM))
        q = F.normalize(query_encoder(queries), dim=-1)
        d = F.normalize(doc_encoder(docs), dim=-1)
        logits = q @ d.T / case.TEMPERATURE
        labels = torch.arange(len(batch))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names = {"query_encoder": query_encoder} if shared else {"query_encoder": query_encoder, "doc_encoder": doc_encoder}
    return {f"{name}.{k}": v.detach() for name, module in names.items() for k, v in module.state_dict().items()}


def assert_matches(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    initial = {
        **{f"query_encoder.{k}": v for k, v in case.make_encoder(case.QUERY_DIM, seed=1).state_dict().items()},
        **{f"doc_encoder.{k}": v for k, v in case.make_encoder(case.DOC_DIM, seed=2).state_dict().items()},
    }
    moved = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    assert moved >= MIN_MOVE, f"the reference barely trained ({moved:.1e}): the test would be weak"
    assert set(trained) == set(expected)
    for key, value in expected.items():
        diff = (trained[key].float() - value).abs().max().item()
        assert diff <= TOLERANCE, f"{key}: max abs difference {diff:.2e} from plain PyTorch"


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda s: f"zero{s}")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    out = tmp_path_factory.mktemp(f"gradcache{request.param}") / "results.pt"
    run_ranks(RUNNER, str(out), str(request.param))
    return request.param, torch.load(out)


def test_chunked_gradients_equal_full_batch_plain_pytorch(results: tuple[int, dict]) -> None:
    _, cases = results
    assert_matches(cases["two"]["weights"], reference(shared=False))
    assert_matches(cases["two_every_chunk"]["weights"], reference(shared=False))
    assert_matches(cases["shared"]["weights"], reference(shared=True))


def test_one_reduction_per_engine_per_step_with_no_sync(results: tuple[int, dict]) -> None:
    stage, cases = results
    chunks = case.LOCAL_BATCH // case.CHUNK
    assert cases["two"]["counts"] == [{"query_encoder": 1, "doc_encoder": 1}] * case.STEPS
    # The shared encoder runs 2 x chunks backwards per step (one per input chunk).
    assert cases["shared"]["counts"] == [{"query_encoder": 1}] * case.STEPS
    # Without deferral ZeRO-2/3 reduce in every chunk's backward; stages 0/1 only ever reduce in step().
    every = chunks if stage >= 2 else 1
    assert cases["two_every_chunk"]["counts"] == [{"query_encoder": every, "doc_encoder": every}] * case.STEPS


def test_step_inside_no_sync_and_nesting_fail_clearly(results: tuple[int, dict]) -> None:
    _, cases = results
    errors = cases["misuse"]["errors"]
    assert "`opt.step()` of engine 'query_encoder' inside `strategy.no_sync(...)`" in errors["step"], errors
    assert "Call `opt.step()` after the `with` block" in errors["step"]
    assert "are inside `strategy.no_sync(...)` already; don't nest them" in errors["nested"], errors
