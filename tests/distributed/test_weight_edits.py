"""Weight edits between steps reach what the next step updates, as under ``DDPStrategy``.

ZeRO-1/2, and bf16 at ZeRO-0/1, step an fp32 master copy of each rank's partition and then overwrite the module's
weights from it. A module that loads other weights when training starts (``load_state_dict`` in
``on_train_start``) and shrinks its weights after every step (``p.data.mul_``, as WGAN's clamp or SwAV's
normalisation edit them, and on odd steps ``p.mul_`` under ``no_grad``, seen by the parameter's version) matches
plain PyTorch doing the same: in fp32 to float tolerance, in bf16 within its resolution. Adam, so that a step from
the wrong weights cannot be undone by the next one.

The same edits inside ``strategy.gathered(name, modifier_rank=0)``, the way for ZeRO-3 (whose weights between steps
are empty partitions), match too, also where rank 1 edits differently (rank 0's edit is every rank's), and with the
optimizer offloaded to host memory.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.checkpoint import consolidated_state_dicts
from tests.distributed.common import (
    AtFitEnd,
    cpu_trainer,
    global_batch,
    regression_data,
    regression_loss,
    regression_model,
    sharded_loader,
)
from tests.distributed.harness import on_ranks

STEPS, PER_RANK, SHRINK = 3, 4, 0.8
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
CASES = [(1, "32-true", None), (2, "32-true", None), (0, "bf16-mixed", None), (2, "bf16-mixed", None)]
CASES += [(2, "bf16-mixed", OFFLOAD)]
IN_BLOCK = [(3, "32-true", None), (3, "bf16-mixed", OFFLOAD), (2, "32-true", None)]
BY_BROADCAST = [(2, "32-true", None)]


def shrink(model: nn.Module, factor: float = SHRINK, direct: bool = False) -> None:
    """Through ``param.data`` (WGAN's clamp), or, ``direct``, on the parameter itself under ``no_grad``."""
    with torch.no_grad():
        for param in model.parameters():
            (param if direct else param.data).mul_(factor)


class Edited(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = regression_model(0)
        self.automatic_optimization = False

    def on_train_start(self) -> None:
        self.net.load_state_dict(regression_model(7).state_dict())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(regression_loss(self.net, batch))
        opt.step()
        shrink(self.net, direct=batch_idx % 2 == 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=0.05)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


class EditedByBroadcast(Edited):
    """:class:`Edited`'s shrink made on rank 0 only, then sent to every rank with ``dist.broadcast(p, src=0)``: a
    collective writes rank 1's weights without raising their versions (``watch_collective_writes`` sees it)."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(regression_loss(self.net, batch))
        opt.step()
        if self.global_rank == 0:
            shrink(self.net, direct=True)
        for param in self.net.parameters():
            torch.distributed.broadcast(param.detach(), src=0)


class EditedInBlock(Edited):
    """:class:`Edited`'s edits inside ``gathered(modifier_rank=0)``; rank 1 shrinks by another factor, dropped."""

    def on_train_start(self) -> None:
        with self.trainer.strategy.gathered("net", modifier_rank=0) as net:
            net.load_state_dict(regression_model(7 if self.global_rank == 0 else 8).state_dict())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(regression_loss(self.net, batch))
        opt.step()
        with self.trainer.strategy.gathered("net", modifier_rank=0) as net:
            shrink(net, SHRINK if self.global_rank == 0 else 0.5)


class EditedOutside(Edited):
    """ZeRO-3, no block: ``shrink`` edits after the step, ``teacher`` moves a frozen ZeRO-3 copy towards the trained
    net by hand (a momentum teacher), ``forward`` reads a weight's ``data`` in its own forward only, and ``child``
    does so calling the net's layers one by one (each gathered by its own forward)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.teacher = regression_model(1).requires_grad_(False)
        if how in ("forward", "child"):
            self.net[0] = ReadsItsWeight(4, 8)

    def on_train_start(self) -> None:
        pass

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        super().training_step(batch, batch_idx) if self.how == "shrink" else self._step_and_follow(batch)

    def _step_and_follow(self, batch: torch.Tensor) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        net = (lambda x: self.net[2](self.net[1](self.net[0](x)))) if self.how == "child" else self.net
        self.manual_backward(regression_loss(net, batch) + 0 * self.teacher(batch[:, :4]).sum())
        opt.step()
        if self.how == "teacher":
            for mine, followed in zip(self.teacher.parameters(), self.net.parameters(), strict=True):
                mine.data.mul_(0.9).add_(followed.detach(), alpha=0.1)


class ReadsItsWeight(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight / self.weight.data.norm().clamp(min=1.0), self.bias)


def edit_outside_blocks() -> dict[str, str]:
    """On each rank: what each :class:`EditedOutside` fit at ZeRO-3 ended with, and whether the classes came back."""
    results, modules = {}, []
    for how in ("shrink", "teacher", "forward", "child"):
        modules.append(EditedOutside(how))
        strategy = MultiDeepSpeedStrategy(stage=3, engine_configs={"teacher": {}})
        trainer = cpu_trainer(strategy, use_distributed_sampler=False, enable_checkpointing=False)
        try:
            trainer.fit(modules[-1])
            results[how] = "ok"
        except RuntimeError as error:
            results[how] = str(error)
    results["restored"] = str(all(type(p) is nn.Parameter for module in modules for p in module.parameters()))
    return results


def fit_edited(folder: str) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """On each rank: the weights after each case's fit, then after each of :data:`IN_BLOCK`'s; and for each of
    :data:`CASES`, the weights of a checkpoint saved in ``folder`` as training ends (even cases) or after the fit
    (odd ones), as ``export`` reads them."""
    weights, saved = [], []
    for module, cases in [(Edited, CASES), (EditedInBlock, IN_BLOCK), (EditedByBroadcast, BY_BROADCAST)]:
        for stage, precision, config in cases:
            at_end = AtFitEnd(lambda strategy: strategy.consolidated_state_dict())
            options = {"use_distributed_sampler": False, "enable_checkpointing": False, "precision": precision}
            strategy = MultiDeepSpeedStrategy(stage=stage, config=config)
            path, in_fit = Path(folder) / f"case{len(saved)}.ckpt", len(saved) % 2 == 0  # else after fit
            saves = [SavesAtTrainEnd(path)] if module is Edited and in_fit else []
            trainer = cpu_trainer(strategy, callbacks=[at_end, *saves], **options)
            trainer.fit(module())
            weights.append({key: value.float() for key, value in at_end.value.items()})
            if module is Edited:
                if not in_fit:
                    trainer.save_checkpoint(path)
                saved.append({f"net.{k}": v for k, v in consolidated_state_dicts(path)["net"].items()})
    return weights, saved


class SavesAtTrainEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` when training ends, the engines still running (as ``ModelCheckpoint``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def reference() -> dict[str, torch.Tensor]:
    model = regression_model(7)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    data = regression_data(STEPS, PER_RANK)
    for step in range(STEPS):
        batch = global_batch(data, step, PER_RANK)
        optimizer.zero_grad()
        regression_loss(model, batch).backward()
        optimizer.step()
        shrink(model)
    return {f"net.{key}": value for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[list, list]]:
    return on_ranks(fit_edited, str(tmp_path_factory.mktemp("edited")))


@pytest.fixture(scope="module")
def fits(launch: list[tuple[list, list]]) -> list[list[dict[str, torch.Tensor]]]:
    """Each rank's weights after each case (:data:`CASES`, :data:`IN_BLOCK`, then :data:`BY_BROADCAST`)."""
    return [weights for weights, _ in launch]


def case_id(stage: int, precision: str, config: dict | None) -> str:
    return f"zero{stage}-{precision}" + ("-offload" if config else "")


def assert_as_pytorch(fits: list[list[dict[str, torch.Tensor]]], case: int, precision: str) -> None:
    expected = reference()
    tolerance = 1e-5 if precision == "32-true" else 3e-2  # bf16 keeps ~3 significant digits
    for rank, weights in enumerate(fits):
        for key, value in expected.items():
            assert (weights[case][key] - value).abs().max() < tolerance, (rank, key)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[case_id(*case) for case in CASES])
def test_weight_edits_between_steps_reach_the_next_step(fits: list[list[dict[str, torch.Tensor]]], case: int) -> None:
    assert_as_pytorch(fits, case, CASES[case][1])


def test_a_checkpoint_saved_after_an_edit_holds_the_edited_weights(launch: list[tuple[list, list]]) -> None:
    """DDP saves the weights it holds; here a checkpoint holds the fp32 master copy, which takes the edit first."""
    saved = [checkpoints for _, checkpoints in launch]  # saved when training ends (even cases) or after fit (odd)
    for case, (_, precision, _) in enumerate(CASES):
        assert_as_pytorch(saved, case, precision)


@pytest.mark.parametrize("case", range(len(IN_BLOCK)), ids=[case_id(*case) for case in IN_BLOCK])
def test_weight_edits_in_a_gathered_block_with_a_modifier_rank_reach_the_next_step(
    fits: list[list[dict[str, torch.Tensor]]], case: int
) -> None:
    assert_as_pytorch(fits, len(CASES) + case, IN_BLOCK[case][1])


def test_weights_a_collective_of_your_code_wrote_reach_the_next_step(fits: list[list[dict[str, torch.Tensor]]]) -> None:
    assert_as_pytorch(fits, len(CASES) + len(IN_BLOCK), BY_BROADCAST[0][1])


def test_a_zero3_weight_touched_through_data_outside_its_forward_and_blocks_is_refused() -> None:
    """Between steps a ZeRO-3 weight is an empty partition: an edit through ``p.data`` would change nothing, unseen."""
    for rank, results in enumerate(on_ranks(edit_outside_blocks)):
        assert results.pop("forward") == "ok", f"rank {rank}: a read in the weight's own forward is DDP's"
        assert results.pop("child") == "ok", f"rank {rank}: so is one in a submodule's forward called directly"
        assert results.pop("restored") == "True", f"rank {rank}: teardown gives the parameters their class back"
        for how, name in [("shrink", "net"), ("teacher", "teacher")]:
            message = results[how]
            expected = f"`param.data` of a parameter of engine {name!r} (ZeRO-3) was read outside its forward (in "
            assert message.startswith(expected + __name__), f"rank {rank}, {how}: {message}"
            assert f"gathered({name!r}, modifier_rank=0)" in message and "ema=" in message, message
