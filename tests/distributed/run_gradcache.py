"""Per-rank script: GradCache steps under MultiDeepSpeedStrategy, weights and reduction counts per case.

Usage: run_gradcache.py OUT STAGE

Cases: two encoder engines and one shared encoder engine, each with deferred sync (``no_sync``) and
without; plus ``misuse``, which records the errors of ``opt.step()`` inside ``no_sync`` and of nesting it.
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.utilities import ReductionCounter
from lightning_multids.utilities.gradcache import grad_cache, info_nce
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")

ROWS, LOCAL_BATCH, CHUNK, STEPS, LR, TEMPERATURE = 64, 16, 4, 2, 0.5, 0.2
QUERY_DIM, DOC_DIM = 12, 8


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


def main() -> None:
    out, stage = sys.argv[1], int(sys.argv[2])
    results = {}
    cases = {
        "two": (False, True, False),
        "two_every_chunk": (False, False, False),
        "shared": (True, True, False),
        "misuse": (True, True, True),
    }
    for case, (shared, defer, misuse) in cases.items():
        module = GradCacheModule(shared, defer, misuse)
        strategy = MultiDeepSpeedStrategy(stage=stage)
        trainer = cpu_trainer(strategy, enable_checkpointing=False, use_distributed_sampler=False)
        trainer.fit(module)
        state = strategy.consolidated_state_dict()
        results[case] = {"weights": state, "counts": module.counts, "errors": module.errors}
    if trainer.global_rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    finish()
