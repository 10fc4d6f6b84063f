"""ZeRO-3: a weight read outside its owner's forward, in a submodule that user code calls itself, matches DDP.

taming-transformers' ``VectorQuantizer2`` measures distances to ``self.embedding.weight`` before it calls
``self.embedding(...)``. At ZeRO-3 that weight is an empty partition there unless DeepSpeed gathers it as an
external parameter, which it does only inside a forward it knows of. Two layouts the user writes: the quantizer a
child of an engine's submodule, called directly (``self.net.quant(...)``), and the quantizer one part of an engine
over several submodules (one optimizer over ``enc``, ``quant`` and ``head``). Each trains 2 steps of SGD on 2 ranks
under ``DDPStrategy`` and under the strategy at ZeRO-3 (no small weight kept whole), and every weight must equal
DDP's. Before the strategy set DeepSpeed's forward flag around such calls, both stopped on the first step with
torch's ``RuntimeError: size mismatch`` from the user's distance computation.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import AtFitEnd, cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

ALL_PARTITIONED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Quantizer(nn.Module):
    """Nearest-code quantization with a straight-through estimator and a codebook loss, as VQ-VAEs write it."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(6, 4)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        codes = self.embedding.weight
        distances = z.pow(2).sum(1, keepdim=True) - 2 * z @ codes.t() + codes.pow(2).sum(1)
        quantized = self.embedding(distances.argmin(1))
        return z + (quantized - z).detach() + (quantized - z.detach()).pow(2).mean()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(5, 4)
        self.quant = Quantizer()
        self.head = nn.Linear(4, 1)


class Quantized(pl.LightningModule):
    """``layout`` "child": ``net`` one engine, its children called directly; "joined": one optimizer over parts."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.automatic_optimization = False
        if layout == "child":
            self.net = Net()
        else:
            self.enc, self.quant, self.head = Net().children()
        self.other = nn.Linear(5, 1)

    def parts(self) -> nn.Module:
        return self.net if self.layout == "child" else self

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt, opt_other = self.optimizers()
        parts, x = self.parts(), batch[:, :5]
        loss = parts.head(parts.quant(parts.enc(x))).pow(2).mean() + self.other(x).pow(2).mean()
        opt.zero_grad()
        opt_other.zero_grad()
        self.manual_backward(loss)
        opt.step()
        opt_other.step()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        parts = self.parts()
        trained = [*parts.enc.parameters(), *parts.quant.parameters(), *parts.head.parameters()]
        return torch.optim.SGD(trained, lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, torch.randn(16, 5, generator=torch.Generator().manual_seed(1)))


def run() -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    results: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for layout in ("child", "joined"):
        ddp = Quantized(layout)
        cpu_trainer(
            DDPStrategy(process_group_backend="gloo"), use_distributed_sampler=False, enable_checkpointing=False
        ).fit(ddp)
        at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
        strategy = MultiDeepSpeedStrategy(stage=3, config=ALL_PARTITIONED)
        cpu_trainer(strategy, use_distributed_sampler=False, enable_checkpointing=False, callbacks=[at_end]).fit(
            Quantized(layout)
        )
        results[layout] = {"ddp": {k: v.detach().clone() for k, v in ddp.state_dict().items()}, "zero3": at_end.value}
    return results


def test_a_weight_read_before_its_owner_runs_matches_ddp_at_zero3() -> None:
    for layout, found in on_ranks(run)[0].items():
        assert found["zero3"].keys() == found["ddp"].keys(), layout
        for key, expected in found["ddp"].items():
            torch.testing.assert_close(found["zero3"][key], expected, rtol=0, atol=1e-6, msg=f"{layout}: {key}")
