"""An optimizer's step over an engine's parameters as ``torch.optim`` takes it, against plain PyTorch.

A 0-dim parameter (a learned temperature, CLIP's ``logit_scale``, SAC's ``log_alpha``) trains at every stage, in a
submodule built in ``__init__`` or in ``configure_model`` (under ``zero.Init`` at ZeRO-3), and a fit saved after its
first epoch resumes to the same weights; the export keeps its shape and loads with ``load_state_dict``.

Optimizers: at ZeRO-1/2/3 DeepSpeed steps the optimizer over flat partitions, so only element-wise ones train
there; a tensor-wise one (Adafactor) trains at ZeRO-0 as in plain PyTorch, and an optimizer the user declares
element-wise (``elementwise_optimizers``), or a subclass of a known one keeping its ``step``, trains at ZeRO-2.
(The refusal of an undeclared one is in ``test_errors``.)
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.checkpoint import consolidated_state_dicts
from tests import patterns
from tests.distributed.common import fit_for_weights, global_batch, regression_data, sharded_loader
from tests.distributed.harness import on_ranks

STEPS, PER_RANK, EPOCHS = 2, 4, 2


class Tempered(nn.Module):
    """A 4-8-1 MLP whose output is scaled by ``exp(log_scale)``, a 0-dim parameter (CLIP's learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.log_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(1) * self.log_scale.exp()


def tempered_loss(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(batch[:, :4]), batch[:, 4])


class LoggingAdam(torch.optim.Adam):
    """A subclass of a known element-wise optimizer that keeps its ``step``."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.created = True


class SignSGD(torch.optim.Optimizer):
    """An element-wise optimizer the strategy does not know: ``p -= lr * sign(grad)``."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.05),
    "logging_adam": lambda params: LoggingAdam(params, lr=0.05),
    "sign_sgd": lambda params: SignSGD(params, lr=0.01),
}


CLIP, SHRINK = 0.1, 0.9


class WithTemperature(pl.LightningModule):
    """``touch``: each step clipped with ``self.clip_gradients``, and the temperature then shrunk on rank 0 inside
    ``strategy.gathered("net", modifier_rank=0)``."""

    def __init__(self, late: bool = False, optimizer: str = "adam", touch: bool = False) -> None:
        super().__init__()
        self.late, self.optimizer, self.touch = late, optimizer, touch
        if not late:
            self.net = Tempered()
        self.automatic_optimization = False

    def configure_model(self) -> None:
        if self.late and not hasattr(self, "net"):
            self.net = Tempered()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(tempered_loss(self.net, batch))
        if self.touch:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        if self.touch:
            with self.trainer.strategy.gathered("net", modifier_rank=0) as net:  # type: ignore[attr-defined]
                if self.global_rank == 0:
                    net.log_scale.mul_(SHRINK)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer](self.net.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(STEPS, PER_RANK), batch_size=PER_RANK)


def fit_with_temperature(folder: str, stage: int, late: bool) -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: the weights after :data:`EPOCHS` epochs in one fit and in two (saved after the first, resumed),
    and the export of the first's checkpoint loaded into a new module."""
    results = {}
    for name, epochs, ckpt in [("whole", EPOCHS, None), ("first", 1, None), ("resumed", EPOCHS, "first")]:
        ckpt_path = f"{folder}/{ckpt}.ckpt" if ckpt else None
        module = WithTemperature(late, touch=True)
        trainer, weights = fit_for_weights(MultiDeepSpeedStrategy(stage=stage), module, ckpt_path, max_epochs=epochs)
        trainer.save_checkpoint(f"{folder}/{name}.ckpt")
        results[name] = {key: value.clone() for key, value in weights.items()}
    exported = Tempered()
    exported.load_state_dict(consolidated_state_dicts(f"{folder}/first.ckpt")["net"])
    results["exported"] = {f"net.{key}": value for key, value in exported.state_dict().items()}
    return results


def fit_optimizers(cases: list[tuple[str, int]]) -> list[dict[str, torch.Tensor]]:
    """On each rank: the weights after a fit with each ``(optimizer, stage)``, ``SignSGD`` declared element-wise."""
    results = []
    for optimizer, stage in cases:
        strategy = MultiDeepSpeedStrategy(stage=stage, elementwise_optimizers=[f"{__name__}.SignSGD"])
        results.append(fit_for_weights(strategy, WithTemperature(optimizer=optimizer))[1])
    return results


def reference(epochs: int, optimizer: str = "adam", touch: bool = False) -> dict[str, torch.Tensor]:
    net = Tempered()
    optimizer = OPTIMIZERS[optimizer](net.parameters())
    data = regression_data(STEPS, PER_RANK)
    for _ in range(epochs):
        for step in range(STEPS):
            optimizer.zero_grad()
            tempered_loss(net, global_batch(data, step, PER_RANK)).backward()
            if touch:
                torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            optimizer.step()
            if touch:
                with torch.no_grad():
                    net.log_scale.mul_(SHRINK)
    return {f"net.{key}": value for key, value in net.state_dict().items()}


@pytest.mark.parametrize(("stage", "late"), [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_a_0_dim_parameter_trains_saves_resumes_and_exports_with_its_shape(
    tmp_path: Path, stage: int, late: bool
) -> None:
    results = on_ranks(fit_with_temperature, str(tmp_path), stage, late)[0]
    expected = {"whole": reference(EPOCHS, touch=True), "resumed": reference(EPOCHS, touch=True)}
    expected["first"] = reference(1, touch=True)
    expected["exported"] = expected["first"]
    for name, weights in expected.items():
        assert results[name].keys() == weights.keys(), name
        for key, value in weights.items():
            assert results[name][key].shape == value.shape, (name, key)
            torch.testing.assert_close(results[name][key], value, msg=f"{name}: {key}")


OPTIMIZER_CASES = [("adafactor", 0), ("logging_adam", 2), ("sign_sgd", 2), ("sign_sgd", 3)]


def test_tensor_wise_optimizers_train_at_zero0_and_declared_element_wise_ones_at_zero2_and_3() -> None:
    results = on_ranks(fit_optimizers, OPTIMIZER_CASES)[0]
    for (optimizer, stage), weights in zip(OPTIMIZER_CASES, results, strict=True):
        for key, value in reference(1, optimizer).items():
            torch.testing.assert_close(weights[key], value, msg=f"{optimizer} at ZeRO-{stage}: {key}")


class TwoHeads(nn.Module):
    """``head(tanh(body(x)))``, plus ``spare(x)`` where asked: a layer some steps leave without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.spare = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, spare: bool) -> torch.Tensor:
        out = self.head(torch.tanh(self.body(x))).squeeze(1)
        return out + self.spare(x).squeeze(1) if spare else out


def partial_loss(net: TwoHeads, batch: torch.Tensor, spare: bool) -> torch.Tensor:
    return nn.functional.mse_loss(net(batch[:, :4], spare), batch[:, 4])


def partial_step(
    net: TwoHeads, batch: torch.Tensor, case: str, step: int, opt: Any, backward: Any, clear_all: Any
) -> None:
    """One step of ``case``, the same for the strategy and plain PyTorch (``clear_all``: the module's ``zero_grad``).

    ``frozen``: every layer used, ``body`` frozen after the first step; ``frozen_base``: ``body`` frozen from the
    start (a LoRA-style base); ``unused``: ``spare`` never used; ``sometimes``: used on even steps only;
    ``offloaded``: the same after an empty ``strategy.offloaded`` block; ``keep_zeros``: ``spare`` never used,
    cleared with ``zero_grad(set_to_none=False)``; ``module_zero_grad``: a loss through ``spare`` backpropagated,
    then the module's ``zero_grad()``, then a loss without it; ``frozen_at_step``, ``frozen_between``: see
    :func:`frozen_holding_a_gradient`.
    """
    if case in ("frozen_at_step", "frozen_between") and step == 1:
        frozen_holding_a_gradient(net, batch, case, opt, backward)
        return
    if case == "frozen" and step == 1:
        net.body.requires_grad_(False)
    opt.zero_grad(set_to_none=case != "keep_zeros")
    if case == "module_zero_grad":
        backward(partial_loss(net, batch, True))
        clear_all()
        backward(partial_loss(net, batch, False))
    else:
        spare = case in ("frozen", "frozen_base") or (case in ("sometimes", "offloaded") and step % 2 == 0)
        backward(partial_loss(net, batch, spare))
    opt.step()


def frozen_holding_a_gradient(net: TwoHeads, batch: torch.Tensor, case: str, opt: Any, backward: Any) -> None:
    """``body`` frozen while it holds the gradient of a backward, which ``torch.optim`` still applies, and trainable
    again after the step: frozen just before ``opt.step()`` (``frozen_at_step``: as Lightning's ``toggle_optimizer``
    freezes the other optimizers' parameters, where one of them is stepped inside the toggle), or between two
    backwards (``frozen_between``: the second one's loss runs through the frozen ``body``)."""
    opt.zero_grad()
    backward(partial_loss(net, batch, False))
    net.body.requires_grad_(False)
    if case == "frozen_between":
        backward(partial_loss(net, batch, False))
    opt.step()
    net.body.requires_grad_(True)


def make_partial_net(case: str) -> TwoHeads:
    net = TwoHeads()
    if case == "frozen_base":
        net.body.requires_grad_(False)
    return net


class Partial(pl.LightningModule):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case, self.net = case, make_partial_net(case)
        self.automatic_optimization = False
        self.copied: dict[str, bool] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.case == "offloaded" and batch_idx == 0:
            with self.trainer.strategy.offloaded("net"):  # type: ignore[attr-defined]
                pass
        partial_step(self.net, batch, self.case, batch_idx, self.optimizers(), self.manual_backward, self.zero_grad)
        if self.case == "module_zero_grad" and batch_idx == 1:
            self.copied = copies_own_zero_grad(self.net)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return partial_optimizer(self.net, self.case)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, regression_data(PARTIAL_STEPS, PER_RANK), batch_size=PER_RANK)


def copies_own_zero_grad(net: nn.Module) -> dict[str, bool]:
    """A deep copy of an engine's submodule during fit (a snapshot): its ``zero_grad`` is torch's and clears it."""
    snapshot = copy.deepcopy(net)
    for param in snapshot.parameters():
        param.grad = torch.ones_like(param)
    snapshot.zero_grad()
    snapshot.body.zero_grad()
    return {"cleared": all(param.grad is None for param in snapshot.parameters())}


def partial_optimizer(net: nn.Module, case: str) -> torch.optim.Optimizer:
    """AdamW, or SGD with momentum where a parameter skips steps and comes back: over ZeRO's flat partitions Adam's
    step count is one per group, so such a parameter is bias-corrected as if it had not (docs/limitations.md)."""
    if case in ("sometimes", "offloaded"):
        return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.5)
    return torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.5)


PARTIAL_STEPS = 3


def fit_partial(cases: list[tuple[str, int, str, bool]]) -> list[dict[str, Any]]:
    """On each rank: the weights after each ``(case, stage, precision, find_unused)`` fit of :class:`Partial`, and
    what its deep copy did (``module_zero_grad``)."""
    results = []
    for case, stage, precision, find_unused in cases:
        strategy, module = MultiDeepSpeedStrategy(stage=stage, find_unused_parameters=find_unused), Partial(case)
        _, weights = fit_for_weights(strategy, module, precision=precision)
        results.append({key: value.float() for key, value in weights.items()} | module.copied)
    return results


def fit_resumed(folder: str, stage: int) -> dict[str, torch.Tensor]:
    """On each rank: ``sometimes`` fitted for 2 epochs, saved after the first and resumed from it."""
    for epochs, ckpt in [(1, None), (2, f"{folder}/first.ckpt")]:
        strategy = MultiDeepSpeedStrategy(stage=stage, find_unused_parameters=True)
        trainer, weights = fit_for_weights(strategy, Partial("sometimes"), ckpt, max_epochs=epochs)
        trainer.save_checkpoint(f"{folder}/first.ckpt")
    return weights


def partial_reference(case: str, epochs: int = 1) -> dict[str, torch.Tensor]:
    net = make_partial_net(case)
    optimizer = partial_optimizer(net, case)
    data = regression_data(PARTIAL_STEPS, PER_RANK)
    for _ in range(epochs):
        for step in range(PARTIAL_STEPS):
            batch = global_batch(data, step, PER_RANK)
            partial_step(net, batch, case, step, optimizer, torch.Tensor.backward, net.zero_grad)
    return {f"net.{key}": value for key, value in net.state_dict().items()}


PARTIAL_CASES = [
    *[("frozen", stage, "32-true", False) for stage in range(4)],
    *[("unused", stage, "32-true", True) for stage in range(4)],
    *[("sometimes", stage, "32-true", True) for stage in (0, 2, 3)],
    *[("frozen_base", stage, "32-true", True) for stage in (1, 3)],
    *[(case, stage, "32-true", True) for case in ("keep_zeros", "module_zero_grad") for stage in (0, 2)],
    *[("offloaded", stage, "32-true", True) for stage in (1, 2)],
]


def test_parameters_without_a_gradient_are_left_as_torch_optim_leaves_them() -> None:
    """Weight decay and momentum move a parameter stepped with a zero gradient; torch.optim skips it."""
    results = on_ranks(fit_partial, PARTIAL_CASES)[0]
    failures = []
    for (case, stage, precision, find_unused), weights in zip(PARTIAL_CASES, results, strict=True):
        for key, value in partial_reference(case).items():
            error = (weights[key] - value).abs().max().item()
            if error > 1e-5:
                failures.append(
                    f"{case} at ZeRO-{stage} {precision} find_unused={find_unused}: {key} off by {error:.3g}"
                )
        if case == "module_zero_grad" and not weights.get("cleared"):
            failures.append(f"a deep copy's zero_grad() at ZeRO-{stage} did not clear the copy: {weights}")
    assert not failures, "\n".join(failures)


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}


def fit_frozen_holding(cases: list[tuple[str, int, bool]]) -> list[dict[str, Any]]:
    """On each rank: the weights after each ``(case, stage, offload)`` fit of :class:`Partial`, or the error."""
    results: list[dict[str, Any]] = []
    for case, stage, offload in cases:
        strategy = MultiDeepSpeedStrategy(stage=stage, config=OFFLOAD if offload else None, find_unused_parameters=True)
        try:
            results.append(fit_for_weights(strategy, Partial(case))[1])
        except RuntimeError as error:
            results.append({"error": str(error)})
    return results


FROZEN_HOLDING = [(case, stage, False) for case in ("frozen_at_step", "frozen_between") for stage in range(4)]
FROZEN_HOLDING += [(case, 2, True) for case in ("frozen_at_step", "frozen_between")]


def test_a_parameter_frozen_while_it_holds_a_gradient_is_stepped_with_it_as_torch_optim_does() -> None:
    """``torch.optim`` steps a parameter whose ``grad`` is set, whatever its ``requires_grad``; DeepSpeed reduces
    (ZeRO-0 in ``step()``, ZeRO-2 offloaded when ``step()`` copies the gradients out) only those that require one, so
    a frozen one was stepped with this rank's own gradient (the ranks apart) or none. At ZeRO-3 a backward that ends
    while it is frozen drops its gradient: refused at that backward."""
    results = on_ranks(fit_frozen_holding, FROZEN_HOLDING)
    failures = []
    for (case, stage, offload), *ranks in zip(FROZEN_HOLDING, *results, strict=True):
        where = f"{case} at ZeRO-{stage}{' offloaded' if offload else ''}"
        if case == "frozen_between" and stage == 3:
            message = str(ranks[0].get("error"))
            expected = "frozen (`requires_grad=False`) and holds a gradient of an earlier backward"
            if expected not in message or ranks[1].get("error") != message:
                failures.append(f"{where}: not refused on every rank: {[r.get('error') for r in ranks]}")
            continue
        for rank, weights in enumerate(ranks):
            if "error" in weights:
                failures.append(f"{where}: rank {rank} raised {weights['error']}")
                continue
            for key, value in partial_reference(case).items():
                error = (weights[key].float() - value).abs().max().item()
                if error > 1e-5:
                    failures.append(f"{where}: {key} off by {error:.3g} on rank {rank}")
    assert not failures, "\n".join(failures)


UNUSED_BF16 = [("unused", stage, "bf16-mixed", True) for stage in range(4)]


def test_in_bf16_a_parameter_never_reached_keeps_its_first_weights() -> None:
    """bf16 engines step an fp32 master copy: the unused layer's comes back as it started, bit for bit (or its bf16
    weights, where the export reads those)."""
    results = on_ranks(fit_partial, UNUSED_BF16)[0]
    start = {f"net.{key}": value for key, value in TwoHeads().state_dict().items() if key.startswith("spare")}
    for (_, stage, _, _), weights in zip(UNUSED_BF16, results, strict=True):
        for key, value in start.items():
            rounded = value.to(torch.bfloat16).float()
            assert torch.equal(weights[key], value) or torch.equal(weights[key], rounded), f"ZeRO-{stage}: {key}"


DCGAN_STEPS = 3


def dcgan_step(
    net_g: nn.Module, net_d: nn.Module, batch: torch.Tensor, opt_g: object, opt_d: object, backward: object
) -> None:
    """One step of PyTorch's DCGAN tutorial, as written there: each model cleared with ``net.zero_grad()``, and G's
    loss backpropagated through D, whose gradients the next step's ``net_d.zero_grad()`` clears."""
    real, z = patterns.split(batch)
    bce = nn.functional.binary_cross_entropy_with_logits
    net_d.zero_grad()
    out = net_d(real).squeeze(1)
    backward(bce(out, torch.ones_like(out)))
    fake = net_g(z)
    out = net_d(fake.detach()).squeeze(1)
    backward(bce(out, torch.zeros_like(out)))
    opt_d.step()
    net_g.zero_grad()
    out = net_d(fake).squeeze(1)
    backward(bce(out, torch.ones_like(out)))
    opt_g.step()


def dcgan_optimizers(net_g: nn.Module, net_d: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.5, 0.999)) for net in (net_g, net_d)]


class DCGAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net_g, self.net_d = patterns.make_modules()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        dcgan_step(self.net_g, self.net_d, batch, *self.optimizers(), self.manual_backward)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return dcgan_optimizers(self.net_g, self.net_d)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(DCGAN_STEPS, 2 * PER_RANK), batch_size=PER_RANK)


def fit_dcgan(stages: list[int]) -> list[dict[str, torch.Tensor]]:
    """On each rank: the weights after a DCGAN fit at each stage."""
    results = []
    for stage in stages:
        results.append(fit_for_weights(MultiDeepSpeedStrategy(stage=stage), DCGAN())[1])
    return results


def dcgan_reference() -> dict[str, torch.Tensor]:
    net_g, net_d = patterns.make_modules()
    opt_g, opt_d = dcgan_optimizers(net_g, net_d)
    data = patterns.make_batches(DCGAN_STEPS, 2 * PER_RANK)
    for step in range(DCGAN_STEPS):
        dcgan_step(net_g, net_d, global_batch(data, step, PER_RANK), opt_g, opt_d, torch.Tensor.backward)
    weights = {f"net_g.{key}": value for key, value in net_g.state_dict().items()}
    return weights | {f"net_d.{key}": value for key, value in net_d.state_dict().items()}


def test_module_zero_grad_clears_what_the_engines_next_step_applies() -> None:
    """PyTorch's DCGAN tutorial clears D with ``netD.zero_grad()``; at ZeRO-2/3 D's reduced gradients of G's loss
    would otherwise reach D's next step."""
    results = on_ranks(fit_dcgan, [0, 2, 3])[0]
    for stage, weights in zip([0, 2, 3], results, strict=True):
        for key, value in dcgan_reference().items():
            torch.testing.assert_close(weights[key], value, msg=f"ZeRO-{stage}: {key}")


def test_a_fit_resumed_after_skipped_steps_matches_an_unbroken_one(tmp_path: Path) -> None:
    """Loading a checkpoint makes DeepSpeed link its parameters to their optimizer state again only at the next
    step: the step after the resume still leaves a skipped layer's momentum as it is."""
    expected = partial_reference("sometimes", epochs=2)
    for stage in (1, 2):
        weights = on_ranks(fit_resumed, str(tmp_path / str(stage)), stage)[0]
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, msg=f"ZeRO-{stage}: {key}")
