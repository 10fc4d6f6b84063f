"""Bad input fails in a real 2-rank fit with a message that names the engine, the setting and the fix.

The rank code, :func:`run_scenarios`, runs each bad-input scenario of :data:`SCENARIOS` through a real 2-rank fit
and each NaN run of :data:`NAN_RUNS`; each rank returns the error each raised.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import on_ranks

ALL_PARTITIONED = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # no small weight kept whole


class GAN(pl.LightningModule):
    def __init__(self, step: Callable[[GAN, torch.Tensor], object] | None = None, optimizers: str = "both") -> None:
        super().__init__()
        self.generator, self.discriminator = patterns.make_modules()
        self.step, self.which = step, optimizers

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> object:
        assert self.step is not None
        return self.step(self, batch)

    def configure_optimizers(self) -> object:
        g = patterns.make_optimizer("sgd", self.generator.parameters())
        d = patterns.make_optimizer("sgd", self.discriminator.parameters())
        if self.which == "none":
            return None
        if self.which == "spanning":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        if self.which == "generator":
            return g
        if self.which == "discriminator":
            return d
        if self.which == "lbfgs":
            return [torch.optim.LBFGS(self.generator.parameters()), d]
        if self.which == "adafactor":
            return [torch.optim.Adafactor(self.generator.parameters()), d]
        return [g, d]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(2), batch_size=4)


class Compiled(GAN):
    """The generator assigned as ``torch.compile`` returns it (compiled lazily, at its first call)."""

    def __init__(self, optimizers: str = "both") -> None:
        super().__init__(returns_loss, optimizers)
        self.generator = torch.compile(self.generator)  # type: ignore[assignment]


class BuiltInConfigureModel(GAN):
    """Both submodules built in ``configure_model`` (ZeRO-3 ones under ``zero.Init``), one optimizer over both."""

    def __init__(self) -> None:
        super().__init__(returns_loss, "spanning")
        del self.generator, self.discriminator

    def configure_model(self) -> None:
        if not hasattr(self, "generator"):
            self.generator, self.discriminator = patterns.make_modules()


def gathers_by_rank(module: GAN, batch: torch.Tensor) -> None:
    """Rank 0 gathers the generator while rank 1 gathers the discriminator."""
    with module.trainer.strategy.gathered(("generator", "discriminator")[module.global_rank]):
        pass


def returns_loss(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    real, z = patterns.split(batch)
    return module.discriminator(module.generator(z)).mean()


def tied_outside_forward(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    """A product with the discriminator's first weight in ``training_step`` itself, outside every forward."""
    real, z = patterns.split(batch)
    return (module.generator(z) @ module.discriminator[0].weight.t()).mean()


def init_outside_forward(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    """The discriminator's last layer re-initialised in place (``nn.init``) in ``training_step``."""
    torch.nn.init.zeros_(module.discriminator[2].weight)
    return returns_loss(module, batch)


def reset_outside_forward(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    """The same through torch's own ``reset_parameters()``."""
    module.discriminator[2].reset_parameters()
    return returns_loss(module, batch)


def average_outside_forward(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    """An EMA over ``discriminator.parameters()`` as diffusers' ``EMAModel.step`` computes it, outside every forward."""
    shadows = module.__dict__.setdefault("shadows", [torch.zeros(16, 6), torch.zeros(16)])
    for shadow, param in zip(shadows, module.discriminator.parameters(), strict=False):
        shadow.sub_(0.1 * (shadow - param))
    return returns_loss(module, batch)


def detached_loss(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    loss = module.discriminator(module.generator(z).detach()).detach().requires_grad_().mean()
    module.manual_backward(loss)


def steps_scheduler(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    _, opt_d = module.optimizers()
    module.manual_backward(module.discriminator(real).mean())
    opt_d.step()
    module.lr_schedulers().step()  # the discriminator's, from its DeepSpeed config: its engine steps it


def calls_engine(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    module.trainer.strategy.engines["generator"](z)


def reads_optimizer_state(module: GAN, batch: torch.Tensor) -> None:
    opt_g, _ = module.optimizers()
    opt_g.state_dict()


def round_trips_optimizer_state(module: GAN, batch: torch.Tensor) -> None:
    """At ZeRO-0 in fp32 the torch optimizer is the engine's: its state_dict round-trips (here, a learning rate)."""
    real, z = patterns.split(batch)
    opt_g, _ = module.optimizers()
    module.manual_backward(module.generator(z).pow(2).mean())
    opt_g.step()
    state = opt_g.state_dict()
    state["param_groups"][0]["lr"] = 0.05
    opt_g.load_state_dict(state)
    if opt_g.param_groups[0]["lr"] != 0.05:
        raise ValueError(f"load_state_dict did not set the learning rate: {opt_g.param_groups[0]}")


def touches_parameter_state(module: GAN, batch: torch.Tensor) -> None:
    """After a step, reads a parameter's state (``torch.optim``'s ``opt.state[p]``), then resets it."""
    real, z = patterns.split(batch)
    opt_g, _ = module.optimizers()
    module.manual_backward(module.generator(z).pow(2).mean())
    opt_g.step()
    param = next(module.generator.parameters())
    if not isinstance(opt_g.state[param], dict):
        raise TypeError(f"opt.state[param] is a {type(opt_g.state[param])}")
    opt_g.state[param] = {}
    if len(opt_g.state) == 0:
        raise ValueError("opt.state holds no state after a step")


def clears_a_part(module: GAN, batch: torch.Tensor) -> None:
    """``zero_grad()`` of one layer of the discriminator between its backward and its step."""
    real, _ = patterns.split(batch)
    _, opt_d = module.optimizers()
    module.manual_backward(module.discriminator(real).mean())
    module.discriminator[0].zero_grad()
    opt_d.step()


def loads_optimizer_state(module: GAN, batch: torch.Tensor) -> None:
    _, opt_d = module.optimizers()
    opt_d.load_state_dict({"state": {}, "param_groups": []})


def steps_without_backward(module: GAN, batch: torch.Tensor) -> None:
    opt_g, _ = module.optimizers()
    opt_g.step()


def clears_before_step(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    opt_g, _ = module.optimizers()
    module.manual_backward(module.discriminator(module.generator(z)).mean())
    opt_g.zero_grad()  # through Lightning's wrapper, as users call it
    opt_g.step()


def plain_backward(module: GAN, batch: torch.Tensor) -> None:
    """A penalty term backpropagated with ``loss.backward()`` beside ``manual_backward``."""
    real, z = patterns.split(batch)
    module.discriminator(real).pow(2).mean().backward()


def autograd_backward(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    torch.autograd.backward([module.discriminator(module.generator(z)).mean()])


def gradients_by_autograd_grad(module: GAN, batch: torch.Tensor) -> None:
    """``torch.autograd.grad`` with respect to an engine's parameters and to the inputs accumulates nothing: allowed."""
    real, z = patterns.split(batch)
    opt_g, opt_d = module.optimizers()
    torch.autograd.grad(module.discriminator(real).mean(), list(module.discriminator.parameters()))
    real = real.clone().requires_grad_()
    (penalty,) = torch.autograd.grad(module.discriminator(real).sum(), real, create_graph=True)
    module.manual_backward(penalty.pow(2).mean() + module.discriminator(module.generator(z)).mean())
    for opt in (opt_g, opt_d):
        opt.step()
        opt.zero_grad()


def penalty_only(module: GAN, batch: torch.Tensor) -> None:
    """WGAN-GP's gradient penalty of the discriminator alone (its second backward needs D's weights whole)."""
    real, _ = patterns.split(batch)
    real = real.clone().requires_grad_()
    (grad,) = torch.autograd.grad(module.discriminator(real).sum(), real, create_graph=True)
    module.manual_backward((grad.pow(2).sum(1) - 1).pow(2).mean())


def penalty_through_a_child(module: GAN, batch: torch.Tensor) -> None:
    """The penalty through the discriminator's first layer called on its own (features of D, not D's output)."""
    real, _ = patterns.split(batch)
    real = real.clone().requires_grad_()
    (grad,) = torch.autograd.grad(module.discriminator[0](real).sum(), real, create_graph=True)
    module.manual_backward((grad.pow(2).sum(1) - 1).pow(2).mean() + module.discriminator(real).mean())


def penalty_inside_the_forward(module: GAN, batch: torch.Tensor) -> None:
    """The penalty computed during the discriminator's own forward (an R1 penalty its `forward` returns)."""
    real, _ = patterns.split(batch)
    real = real.clone().requires_grad_()
    penalties = []

    def penalty(layer: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        (grad,) = torch.autograd.grad(output.sum(), real, create_graph=True)
        penalties.append(grad.pow(2).mean())

    handle = module.discriminator[0].register_forward_hook(penalty)
    try:
        score = module.discriminator(real)
    finally:
        handle.remove()
    module.manual_backward(score.mean() + penalties[0])


def penalty_through_frozen(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    """The generator trained on the gradient of a frozen discriminator at its samples (a penalty through D)."""
    _, z = patterns.split(batch)
    fake = module.generator(z)
    (grad,) = torch.autograd.grad(module.discriminator(fake).sum(), fake, create_graph=True)
    return grad.pow(2).mean() + fake.mean()


def reaches_on_rank_zero_only(module: GAN, batch: torch.Tensor) -> None:
    """Both engines called on every rank; D's term added on rank 0 only (a data-dependent term)."""
    real, z = patterns.split(batch)
    fake = module.generator(z)
    loss = fake.pow(2).mean()
    adversarial = module.discriminator(fake).mean()
    module.manual_backward(loss + adversarial if module.global_rank == 0 else loss)


def reads_inside_no_sync(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    with module.trainer.strategy.no_sync():
        module.manual_backward(module.discriminator(module.generator(z)).mean())
        module.trainer.strategy.full_gradients("discriminator")


def reads_full_gradients(module: GAN, batch: torch.Tensor) -> None:
    real, z = patterns.split(batch)
    module.manual_backward(module.discriminator(module.generator(z)).mean())
    module.trainer.strategy.full_gradients("discriminator")


def nan_in_discriminator(module: GAN, batch: torch.Tensor) -> None:
    """gan_zero_first, with a NaN in the discriminator's loss on rank 1 from the second batch on."""
    opt_g, opt_d = module.optimizers()
    if module.global_rank == 1 and module.trainer.global_step >= 2:
        batch = batch.clone()
        batch[0, 0] = float("nan")  # a real sample: only the discriminator sees it
    patterns.gan_zero_first(module.generator, module.discriminator, batch, opt_g, opt_d, module.manual_backward)


def skips_odd_batches(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    """Manual optimization chosen by the user: every other batch only returns its loss, as Lightning allows."""
    real, z = patterns.split(batch)
    loss = module.discriminator(module.generator(z)).mean()
    module.batches_seen = getattr(module, "batches_seen", 0) + 1
    if module.batches_seen % 2:
        opt_g, _ = module.optimizers()
        module.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
    return loss


class UserManual(GAN):
    def __init__(self, step: Callable[[GAN, torch.Tensor], object]) -> None:
        super().__init__(step)
        self.automatic_optimization = False


class Lightning1x(GAN):
    """``training_step`` as Lightning 1.x called it, once per optimizer."""

    def training_step(self, batch: torch.Tensor, batch_idx: int, optimizer_idx: int) -> object:  # type: ignore[override]
        return returns_loss(self, batch)


class ForcedAutomatic(GAN):
    @property
    def automatic_optimization(self) -> bool:
        return True

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        pass


SCHEDULED = {  # an optimizer and a scheduler from the DeepSpeed config: the engine steps both in opt.step()
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 2}},
}


class WithHead(GAN):
    """The GAN with a submodule that has no parameters."""

    def __init__(self) -> None:
        super().__init__(returns_loss)
        self.head = torch.nn.Tanh()


class FrozenFirstLayer(GAN):
    """The generator's first weight frozen when the engines are built, in its optimizer all the same."""

    def __init__(self) -> None:
        super().__init__(unfreezes_and_trains)
        self.generator[0].weight.requires_grad_(False)


def unfreezes_and_trains(module: GAN, batch: torch.Tensor) -> None:
    """Gradual unfreezing: the frozen layer requires gradients again, then the generator trains."""
    module.generator[0].weight.requires_grad_(True)
    real, z = patterns.split(batch)
    opt_g, _ = module.optimizers()
    module.manual_backward(module.discriminator(module.generator(z)).mean())
    opt_g.step()


class WithBackbone(GAN):
    """The generator as a ``backbone`` for Lightning's ``BackboneFinetuning``; the discriminator, the trained head."""

    def __init__(self) -> None:
        super().__init__(returns_loss, "discriminator")
        self.backbone = self.generator


class AveragesAPart(GAN):
    """One SGD over the generator and the discriminator (one engine), and an EMA copy of the discriminator."""

    def __init__(self) -> None:
        super().__init__(returns_loss)
        self.average = copy.deepcopy(self.discriminator)

    def configure_optimizers(self) -> object:
        return torch.optim.SGD([*self.generator.parameters(), *self.discriminator.parameters()], lr=0.1)


class PolicyOnly(torch.nn.Sequential):
    """Overrides ``parameters()`` without ``recurse``, as x-transformers' ``DPO`` (its policy's only)."""

    def parameters(self):  # type: ignore[override]
        return self[0].parameters()


class WithPolicyOnly(GAN):
    """The GAN whose discriminator is a :class:`PolicyOnly`."""

    def __init__(self) -> None:
        super().__init__(returns_loss)
        self.discriminator = PolicyOnly(*self.discriminator)


class WithProbe(GAN):
    """The GAN with a submodule that reuses the discriminator's first layer."""

    def __init__(self, step: Callable[[GAN, torch.Tensor], object] = returns_loss) -> None:
        super().__init__(step)
        self.probe = torch.nn.Sequential(self.discriminator[0])


class ProbeOnOneOptimizer(GAN):
    """A probe over the discriminator's first layer and a head of its own, one optimizer over the probe's parameters."""

    def __init__(self) -> None:
        super().__init__(returns_loss)
        self.probe = torch.nn.Sequential(self.discriminator[0], torch.nn.Linear(16, 1))

    def configure_optimizers(self) -> object:
        return [torch.optim.SGD(self.generator.parameters(), lr=0.1), torch.optim.SGD(self.probe.parameters(), lr=0.1)]


def trains_through_probe(module: GAN, batch: torch.Tensor) -> None:
    """A plain submodule reusing a ZeRO-0/1/2 engine's layer: the loss reaches that engine through it, as under DDP."""
    real, _ = patterns.split(batch)
    _, opt_d = module.optimizers()
    before = module.discriminator[0].weight.detach().clone()
    module.manual_backward(module.probe(real).pow(2).mean())
    opt_d.step()
    opt_d.zero_grad()
    if torch.equal(before, module.discriminator[0].weight):
        raise RuntimeError("the shared layer did not train")


def sharing(probe_stage: int | None, discriminator_stage: int) -> dict:
    """``probe_stage=None``: the probe has no entry, so it is a plain submodule."""
    engines: dict = {"discriminator": {"zero_optimization": {"stage": discriminator_stage}}}
    if probe_stage is not None:
        engines["probe"] = {"zero_optimization": {"stage": probe_stage}}
    return {"stage": 0, "engine_configs": engines}


SHARED = {  # (probe's stage or None for plain, discriminator's stage)
    f"shared_{'plain' if p is None else f'frozen{p}'}_trained{d}": (p, d)
    for p, d in [(0, 2), (3, 3), (3, 2), (2, 0), (None, 3)]
}


SCENARIOS: dict[str, tuple[Callable[[], GAN], dict]] = {
    **{name: (WithProbe, sharing(p, d)) for name, (p, d) in SHARED.items()},
    **{f"shared_plain_trained{d}": (lambda: WithProbe(trains_through_probe), sharing(None, d)) for d in (0, 2)},
    "shared_plain_trained2_find_unused": (
        lambda: WithProbe(trains_through_probe),
        {**sharing(None, 2), "find_unused_parameters": True},
    ),
    "no_optimizer": (lambda: GAN(optimizers="none"), {}),
    "spanning_optimizer": (lambda: GAN(returns_loss, "spanning"), {}),
    "spanning_optimizer_entry_of_a_part": (
        lambda: GAN(returns_loss, "spanning"),
        {"engine_configs": {"discriminator": {"zero_optimization": {"stage": 3}}}},
    ),
    "spanning_optimizer_part_built_partitioned": (  # the part's own config (the default) is ZeRO-3, the engine's not
        BuiltInConfigureModel,
        {"stage": 3, "engine_configs": {"generator": {"zero_optimization": {"stage": 0}}}},
    ),
    "spanning_optimizer_shared_layer": (ProbeOnOneOptimizer, {"engine_configs": {"probe": {}}}),
    "unknown_engine_key": (lambda: GAN(returns_loss), {"engine_configs": {"critic": {}}}),
    "optimizer_in_both": (lambda: GAN(), {"engine_configs": {"discriminator": {"optimizer": {"type": "SGD"}}}}),
    "fp16_on_cpu": (lambda: GAN(), {"engine_configs": {"generator": {"fp16": {"enabled": True}}}}),
    "clip_on_frozen": (
        lambda: GAN(returns_loss, "generator"),
        {"engine_configs": {"discriminator": {"gradient_clipping": 1.0}}},
    ),
    "returned_loss_in_manual": (lambda: GAN(returns_loss), {}),
    "closure_optimizer": (lambda: GAN(optimizers="lbfgs"), {}),
    "tensorwise_optimizer": (lambda: GAN(optimizers="adafactor"), {}),
    "tensorwise_config_optimizer": (
        lambda: GAN(returns_loss, "discriminator"),
        {"engine_configs": {"generator": {"optimizer": {"type": "Adafactor", "params": {"lr": 0.01}}}}},
    ),
    "backbone_finetuning": (WithBackbone, {}),
    **{f"unfrozen_zero{stage}": (FrozenFirstLayer, {"stage": stage}) for stage in (0, 2, 3)},
    "unfrozen_zero0_bf16": (FrozenFirstLayer, {"stage": 0}),
    "compiled_zero3": (Compiled, {"stage": 3}),
    "compiled_frozen_zero3": (lambda: Compiled("discriminator"), {"stage": 3, "engine_configs": {"generator": {}}}),
    "returned_loss_in_user_manual": (lambda: UserManual(skips_odd_batches), {}),
    "accumulate_when_switched": (lambda: GAN(returns_loss), {}),
    "detached_loss": (lambda: GAN(detached_loss), {}),
    "scheduler_stepped_by_user": (
        lambda: GAN(steps_scheduler, "generator"),
        {"engine_configs": {"discriminator": SCHEDULED}},
    ),
    "forced_automatic": (lambda: ForcedAutomatic(returns_loss), {}),
    "optimizer_idx": (Lightning1x, {}),
    "batch_contradiction": (
        lambda: GAN(returns_loss),
        {"engine_configs": {"generator": {"train_micro_batch_size_per_gpu": 16}}},
    ),
    "engine_called_directly": (lambda: GAN(calls_engine), {}),
    "step_without_backward": (lambda: GAN(steps_without_backward), {}),
    "optimizer_state_dict_zero3": (lambda: GAN(reads_optimizer_state), {"stage": 3}),
    "optimizer_state_dict_zero0_bf16": (lambda: GAN(reads_optimizer_state), {"stage": 0}),
    "optimizer_state_dict_zero0": (lambda: GAN(round_trips_optimizer_state), {"stage": 0}),
    "optimizer_load_state_dict": (lambda: GAN(loads_optimizer_state), {"stage": 2}),
    "zero_grad_of_a_part": (lambda: GAN(clears_a_part), {"stage": 2}),
    **{f"parameter_state_zero{stage}": (lambda: GAN(touches_parameter_state), {"stage": stage}) for stage in (0, 2, 3)},
    "zero_grad_before_step": (lambda: GAN(clears_before_step), {}),
    "offload_with_torch_optimizer": (
        lambda: GAN(returns_loss, "generator"),
        {"engine_configs": {"generator": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}}},
    ),
    "gathered_differs_by_rank": (lambda: GAN(gathers_by_rank), {"stage": 3}),
    "accumulation_dtype_at_zero0": (
        lambda: GAN(returns_loss),
        {"stage": 0, "engine_configs": {"discriminator": {"data_types": {"grad_accum_dtype": "bf16"}}}},
    ),
    "frozen_without_parameters": (WithHead, {"engine_configs": {"head": {"zero_optimization": {"stage": 3}}}}),
    "ema_of_another_shape": (lambda: GAN(returns_loss, "generator"), {"ema": {"discriminator": ("generator", 0.9)}}),
    "ema_that_is_trained": (lambda: GAN(returns_loss, "generator"), {"ema": {"generator": ("discriminator", 0.9)}}),
    "ema_of_a_part": (AveragesAPart, {"ema": {"average": ("discriminator", 0.9)}}),
    "parameters_without_recurse_zero3": (WithPolicyOnly, {"stage": 3}),
    **{f"plain_backward_zero{stage}": (lambda: GAN(plain_backward), {"stage": stage}) for stage in range(4)},
    "autograd_backward": (lambda: GAN(autograd_backward), {"stage": 3}),
    "autograd_grad_allowed": (lambda: GAN(gradients_by_autograd_grad), {"stage": 2}),
    "penalty_through_zero3": (lambda: GAN(penalty_only), {"stage": 3}),
    "penalty_through_a_child_zero3": (lambda: GAN(penalty_through_a_child), {"stage": 3}),
    "penalty_through_its_forward_zero3": (lambda: GAN(penalty_inside_the_forward), {"stage": 3}),
    "penalty_through_frozen_zero3": (
        lambda: GAN(penalty_through_frozen, "generator"),
        {"engine_configs": {"discriminator": {"zero_optimization": {"stage": 3}}}},
    ),
    # the same penalty with the generator at ZeRO-3 and D at 2: its second backward is first-order through G
    "penalty_at_the_output_of_zero3": (
        lambda: GAN(penalty_through_frozen, "generator"),
        {"stage": 3, "engine_configs": {"discriminator": {"zero_optimization": {"stage": 2}}}},
    ),
    "uneven_reach_zero3": (
        lambda: GAN(reaches_on_rank_zero_only),
        {
            "stage": 1,
            "engine_configs": {"discriminator": {"zero_optimization": {"stage": 3}}},
            "find_unused_parameters": True,  # without it, as under DDP, rank 0 waits in ZeRO-3's gathering
        },
    ),
    **{f"full_gradients_in_no_sync_zero{s}": (lambda: GAN(reads_inside_no_sync), {"stage": s}) for s in (2, 3)},
    "full_gradients_offloaded_zero2": (
        lambda: GAN(reads_full_gradients),
        {
            "stage": 2,
            "engine_configs": {
                "discriminator": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            },
            "config": {"zero_force_ds_cpu_optimizer": False},
        },
    ),
    **{
        f"{use}_outside_forward_zero3": (lambda step=step: GAN(step), {"stage": 3, "config": ALL_PARTITIONED})
        for use, step in (
            ("tied", tied_outside_forward),
            ("init", init_outside_forward),
            ("reset", reset_outside_forward),
            ("average", average_outside_forward),
        )
    },
}


TRAINER_KWARGS: dict[str, dict] = {
    "accumulate_when_switched": {"accumulate_grad_batches": 2},
    "optimizer_state_dict_zero0_bf16": {"precision": "bf16-mixed"},
    "unfrozen_zero0_bf16": {"precision": "bf16-mixed"},
    "backbone_finetuning": {"callbacks": [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], "max_epochs": 2},
}


NAN_RUNS: dict[str, tuple[int, str, dict]] = {
    # name: (stage, Trainer precision, discriminator's DeepSpeed config). Each is a different place that
    # refuses the step, or applies it: the torch optimizer (stage 0, fp32) applies it, as under DDP (its pre-hook
    # refuses it only under anomaly mode, tests/unit/test_nonfinite.py), BF16_Optimizer's norm (stage 0, bf16),
    # the ZeRO-1/2 gradient norm (fp32), the ZeRO-1/2 overflow check (bf16, and forced on where a config turns
    # it and the norm off), the ZeRO-3 norm.
    "zero0": (0, "32-true", {}),
    "zero1": (1, "32-true", {}),
    "zero2": (2, "32-true", {}),
    "zero3": (3, "32-true", {}),
    "zero0_bf16": (0, "bf16-mixed", {}),
    "zero2_bf16_unchecked": (2, "bf16-mixed", {"bf16": {"enabled": True, "check_grad_overflow": False}}),
    "zero1_unnormed": (1, "32-true", {"zero_optimization": {"compute_grad_norm": False}}),
}


class WeightsBefore(pl.Callback):
    """Records the consolidated weights when the batch with the NaN starts (a collective call on every rank)."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object, index: int) -> None:
        if index == 1:
            # copies: at ZeRO-0 the state dict shares the weights' storage, as a module's state_dict does
            self.weights = {key: value.clone() for key, value in trainer.strategy.consolidated_state_dict().items()}


def nan_run(name: str, messages: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """A NaN reaches the discriminator on one rank: every rank refuses that step; no weights change.

    Its FloatingPointError goes into ``messages`` as ``nan_NAME``; the weights before and after are returned.
    """
    stage, precision, config = NAN_RUNS[name]
    module, before = GAN(nan_in_discriminator), WeightsBefore()
    strategy = MultiDeepSpeedStrategy(stage=stage, engine_configs={"discriminator": config})
    trainer = cpu_trainer(
        strategy, precision=precision, callbacks=[before], enable_checkpointing=False, use_distributed_sampler=False
    )
    module.train_dataloader = lambda: sharded_loader(module, patterns.make_batches(2))  # type: ignore[method-assign]
    try:
        trainer.fit(module)
    except FloatingPointError as err:
        messages[f"nan_{name}"] = str(err).replace("\n", " ")
    return {"before": before.weights, "after": trainer.strategy.consolidated_state_dict()}


def run_scenarios() -> dict[str, Any]:
    """On each rank: every scenario and NaN run; the messages by name, and (rank 0) the NaN runs' weights."""
    messages: dict[str, str] = {}
    for name, (make_module, kwargs) in SCENARIOS.items():
        options = TRAINER_KWARGS.get(name, {})
        trainer = cpu_trainer(MultiDeepSpeedStrategy(**kwargs), enable_checkpointing=False, **options)
        try:
            trainer.fit(make_module())
        except (ValueError, RuntimeError) as err:
            messages[name] = " ".join([str(err), *getattr(err, "__notes__", ())]).replace("\n", " ")
        else:
            messages[name] = "no error"
    weights = {name: nan_run(name, messages) for name in NAN_RUNS}
    return {"messages": messages, "weights": weights if torch.distributed.get_rank() == 0 else None}


EXPECTED = {
    "no_optimizer": r"configure_optimizers` returned None, so no engine would train.*one optimizer per submodule",
    "spanning_optimizer": r"^no error$",  # one engine over both, named 'generator'
    "spanning_optimizer_entry_of_a_part": r"`engine_configs` has an entry for 'discriminator', which one optimizer "
    r"trains with 'generator', 'discriminator'.*one DeepSpeed engine, named 'generator'.*Key the entry 'generator'",
    "spanning_optimizer_part_built_partitioned": r"engine 'generator' \(one optimizer over 'generator', "
    r"'discriminator'\) runs ZeRO-0, but \['discriminator'\] were built partitioned under `zero.Init`.*key the stage "
    r"in the `engine_configs` entry 'generator' and in the strategy's `stage=` alike",
    "spanning_optimizer_shared_layer": r"entry for 'probe', which one optimizer trains with 'discriminator', "
    r"'probe'.*'discriminator' is in it only through parameters that 'probe' shares with it.*Key the entry "
    r"'discriminator'",
    "unknown_engine_key": r"entry for 'critic'.*no submodule of that name",
    "optimizer_in_both": r"engine .discriminator. gets an optimizer from `configure_optimizers` and its DeepSpeed",
    "fp16_on_cpu": r"engine 'generator' enables fp16, which DeepSpeed does not run on a CPU.*bf16-mixed",
    "clip_on_frozen": r"engine 'discriminator' has no optimizer.*`gradient_clipping` setting would do nothing",
    "returned_loss_in_manual": r"returned a loss but called no `self.manual_backward`.*'generator', 'discriminator'",
    "detached_loss": r"reaches no trainable engine",
    "backbone_finetuning": r"`add_param_group\(...\)` on the optimizer of engine 'discriminator'.*BackboneFinetuning.*"
    r"Give the layers to unfreeze later their optimizer in `configure_optimizers` from the start",
    "unfrozen_zero0": r"^no error$",  # ZeRO-0's torch optimizer steps every parameter with a gradient
    **{
        f"unfrozen_zero{name}": rf"parameter '0.weight' of engine 'generator' had `requires_grad=False` when the "
        rf"engine was built and requires a gradient now: its optimizer \(ZeRO-{stage} in {dtype}\).*give 'generator' "
        r"ZeRO-0 in fp32"
        for name, stage, dtype in [("0_bf16", 0, "bfloat16"), ("2", 2, "float32"), ("3", 3, "float32")]
    },
    "closure_optimizer": r"optimizer of engine 'generator' \(`torch.optim.lbfgs.LBFGS`\) needs a closure.*"
    r"Give 'generator' an optimizer that steps without one",
    "tensorwise_config_optimizer": r"engine 'generator' runs ZeRO-2, where DeepSpeed steps its optimizer "
    r"\(`torch.optim.Adafactor` \(its config's `optimizer`\)\) over flat partitions.*Give 'generator' ZeRO-0",
    "tensorwise_optimizer": r"engine 'generator' runs ZeRO-2, where DeepSpeed steps its optimizer "
    r"\(`torch\.optim\.(_adafactor\.)?Adafactor`\) over flat partitions.*Give 'generator' ZeRO-0.*"
    r"elementwise_optimizers=\[\"torch\.optim\.(_adafactor\.)?Adafactor\"\]",
    **{
        f"compiled_{kind}zero3": r"submodule 'generator' is a `torch.compile`d module and its engine runs ZeRO-3.*"
        r"Give 'generator' ZeRO-0/1/2"
        for kind in ("", "frozen_")
    },
    "returned_loss_in_user_manual": r"^no error$",  # Lightning allows it: the returned loss is detached
    "accumulate_when_switched": r"accumulate_grad_batches=2\)`: `GAN` has 2 trainable engines.*manual_backward\(loss",
    "scheduler_stepped_by_user": r"scheduler of engine 'discriminator' is stepped by its optimizer",
    "forced_automatic": r"2 trainable engines but keeps `automatic_optimization` True.*remove the",
    "optimizer_idx": r"Remove the `optimizer_idx` argument from `training_step`",
    "batch_contradiction": r"engine 'generator' sets train_micro_batch_size_per_gpu=16.*gives 4 samples per process",
    "engine_called_directly": r"engine .generator. was called directly. Call the submodule instead \(`self.gen",
    "optimizer_state_dict_zero3": r"`opt.state_dict\(\)` of engine 'generator'.*flat fp32 partitions.*"
    r"trainer.save_checkpoint\(path\)`.*`deepspeed.utils.safe_get_full_optimizer_state\(param, \"exp_avg\"\)`",
    "optimizer_state_dict_zero0_bf16": r"`opt.state_dict\(\)` of engine 'generator'.*beside fp32 copies.*"
    r"trainer.save_checkpoint\(path\)` and `trainer.fit\(model, ckpt_path=path\)`, which write and read every "
    r"engine's part.$",  # no per-parameter helper: DeepSpeed's return nothing at ZeRO-0
    "optimizer_state_dict_zero0": r"^no error$",
    "parameter_state_zero0": r"^no error$",  # the torch optimizer's own state, per parameter
    "zero_grad_of_a_part": r"`zero_grad\(\)` of `0`, a part of the engine 'discriminator', while the engine holds "
    r"gradients.*Clear the whole engine \(`self.discriminator.zero_grad\(\)`",
    **{
        f"parameter_state_zero{stage}": r"`opt.state\[param\]` of engine 'generator': DeepSpeed keeps this optimizer's "
        r"state in its own flat fp32 partitions.*`deepspeed.utils.safe_get_full_optimizer_state\(param, \"exp_avg\"\)` "
        r"on every rank"
        for stage in (2, 3)
    },
    "optimizer_load_state_dict": r"`opt.load_state_dict\(...\)` of engine 'discriminator'.*ckpt_path=path.*"
    r"safe_set_full_optimizer_state\(param, value, \"exp_avg\"\)",
    "step_without_backward": r"`opt.step\(\)` of engine 'generator' was called with no gradient.*manual_backward",
    "zero_grad_before_step": r"engine 'generator' was called with no gradient since its last step or `zero_grad\(\)`",
    "accumulation_dtype_at_zero0": r"engine 'discriminator' sets `data_types.grad_accum_dtype: 'bf16'` with fp32 "
    r"weights at ZeRO-0.*ZeRO-1 or higher",
    "offload_with_torch_optimizer": r"engine 'generator' offloads its optimizer states .*`torch.optim.sgd.SGD`.*"
    r"DeepSpeedCPUAdam\(self.generator.parameters\(\), ...\).*zero_force_ds_cpu_optimizer",
    "gathered_differs_by_rank": r"`strategy.gathered\('(generator|discriminator)'\)`: rank\(s\) \[[01]\] "
    r"entered another block at the same time. Every rank must enter the same `gathered` blocks in the same order.",
    "frozen_without_parameters": r"submodule 'head' has an `engine_configs` entry and no optimizer.*no parameters.*"
    r"Remove its entry",
    **{
        f"shared_frozen{p}_trained{d}": r"engines 'discriminator' and 'probe' share a parameter.*frozen one turns "
        r"their gradients off.*If 'probe' only reuses the layer, remove its `engine_configs` entry.*moving average of "
        r"'discriminator'.*`MultiDeepSpeedStrategy\(ema=...\)`"
        for p, d in [(0, 2), (3, 3), (3, 2), (2, 0)]
    },
    "shared_plain_trained3": r"plain submodule 'probe' shares a parameter with the ZeRO-3 engine 'discriminator'.*"
    r"copy that does not train. Give 'discriminator' ZeRO-0/1/2.*moving average of 'discriminator'.*"
    r"`MultiDeepSpeedStrategy\(ema=...\)`",
    "shared_plain_trained0": r"^no error$",  # ZeRO-0 fills the discriminator's unreached parameters with zeros
    "shared_plain_trained2": r"reached engine 'discriminator' but not all of its trained parameters \(2.weight, "
    r"2.bias\).*find_unused_parameters=True",
    "shared_plain_trained2_find_unused": r"^no error$",
    "ema_of_another_shape": r"EMA engine 'discriminator' cannot average 'generator': their parameters differ.*deepcopy",
    "ema_that_is_trained": r"EMA engine 'generator' \(`ema=`\) has an optimizer.*stop returning an optimizer over",
    "ema_of_a_part": r"EMA engine 'average' averages 'discriminator', which one optimizer trains with 'generator' "
    r"as the engine 'generator'.*Give the source its own optimizer",
    "parameters_without_recurse_zero3": r"^The submodule 'discriminator' "
    r"\(tests\.distributed\.test_errors\.PolicyOnly\) overrides `parameters\(\)` so that it does not take "
    r"`recurse` or does not return all of its parameters, and engine 'discriminator' runs ZeRO-3.*Give "
    r"'discriminator' ZeRO-0/1/2",
    **{
        f"plain_backward_zero{stage}": r"backward outside `self.manual_backward` reached the parameters of engine "
        r"'discriminator'.*replace the call with `self.manual_backward\(loss\)`"
        for stage in range(4)
    },
    "autograd_backward": r"outside `self.manual_backward` reached the parameters of engine '(generator|discriminator)'",
    "autograd_grad_allowed": r"^no error$",
    "uneven_reach_zero3": r"The loss reaches the ZeRO-3 engine 'discriminator' on some ranks and not on others.*"
    r"`loss \+ 0.0 \* term`.*ZeRO-0/1/2 for 'discriminator'",
    **{
        f"penalty_through_{kind}zero3": r"^A backward with `create_graph=True` \(a gradient penalty.*runs "
        r"through engine 'discriminator' \(ZeRO-3\).*Give 'discriminator', and every engine the penalty runs through, "
        r"ZeRO-0/1/2"
        for kind in ("", "frozen_", "a_child_", "its_forward_")
    },
    "penalty_at_the_output_of_zero3": r"^no error$",
    "full_gradients_offloaded_zero2": r"`full_gradients\('discriminator'\)` cannot read the ZeRO-2 engine "
    r"'discriminator' with `zero_optimization.offload_optimizer` set.*Remove the setting from that engine's config, "
    r"or use ZeRO-1 or ZeRO-3 for it",
    **{  # at ZeRO-3 the block's exception path then clears whole local gradients (ZeRO-3's zero_grad failed on them)
        f"full_gradients_in_no_sync_zero{stage}": rf"`full_gradients\('discriminator'\)` inside `strategy.no_sync"
        rf"\(...\)`: the ZeRO-{stage} engine .*Read them after the `with` block"
        for stage in (2, 3)
    },
    **{
        f"{use}_outside_forward_zero3": rf"^`{param}` of engine 'discriminator' \(ZeRO-3\) was read outside every "
        rf"forward of 'discriminator' \(in {reader}\).*an empty tensor.*Use it inside the forward of a submodule of "
        r"'discriminator'.*gathered\('discriminator', modifier_rank=0\)"
        for use, param, reader in (
            ("tied", r"0\.weight", __name__),
            ("init", r"2\.weight", __name__),
            ("reset", r"2\.weight", r"torch\.nn\.modules\.linear\.reset_parameters"),
        )
    },
    "average_outside_forward_zero3": r"The size of tensor a \(6\) must match the size of tensor b \(0\).* "
    r"MultiDeepSpeedStrategy: `param` in average_outside_forward \(.*test_errors\.py:\d+\) is `0\.weight` of "
    r"engine 'discriminator' \(ZeRO-3\).*an empty tensor.*gathered\('discriminator'\).*ema=",
}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return on_ranks(run_scenarios, timeout=300)


@pytest.fixture(scope="module")
def weights_after_nan(ranks: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Rank 0's weights before and after each NaN run, by its name."""
    return ranks[0]["weights"]


@pytest.fixture(scope="module")
def results(ranks: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    return {rank: result["messages"] for rank, result in enumerate(ranks)}


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_scenario_raises_a_clear_error_on_every_rank(results: dict[int, dict[str, str]], scenario: str) -> None:
    for rank, messages in results.items():
        assert scenario in messages, f"rank {rank} did not run {scenario}"
        assert re.search(EXPECTED[scenario], messages[scenario]), f"rank {rank}: {messages[scenario]}"


APPLIED_AS_DDP = "zero0"
"""The NaN run whose step is applied, as ``DDPStrategy`` applies it: a torch optimizer at ZeRO-0 in fp32."""


def test_at_zero0_in_fp32_a_nan_step_is_applied_as_under_ddp(
    results: dict[int, dict[str, str]], weights_after_nan: dict[str, dict[str, dict[str, torch.Tensor]]]
) -> None:
    """No flag is read in the default step (a host-device sync on a GPU): the NaN reaches the weights, as DDP's."""
    for rank, messages in results.items():
        assert f"nan_{APPLIED_AS_DDP}" not in messages, f"rank {rank}: {messages[f'nan_{APPLIED_AS_DDP}']}"
    weights = weights_after_nan[APPLIED_AS_DDP]
    assert all(torch.isfinite(value).all() for value in weights["before"].values())
    assert not all(torch.isfinite(weights["after"][key]).all() for key in weights["after"] if "discriminator" in key)


@pytest.mark.parametrize("run", [run for run in NAN_RUNS if run != APPLIED_AS_DDP])
def test_nan_gradient_in_one_engine_is_reported_and_changes_no_weights(
    results: dict[int, dict[str, str]], weights_after_nan: dict[str, dict[str, dict[str, torch.Tensor]]], run: str
) -> None:
    """Rank 1 feeds a NaN to the discriminator at its second step: both ranks refuse that step."""
    for rank, messages in results.items():
        assert f"nan_{run}" in messages, f"rank {rank} raised no FloatingPointError"
        assert re.search(r"engine 'discriminator' is NaN or infinite at its step 2", messages[f"nan_{run}"]), rank
    # The refused step is the first of the second batch: the weights are those the batch started with.
    weights = weights_after_nan[run]
    for key, value in weights["before"].items():
        assert torch.equal(weights["after"][key], value), key
        assert torch.isfinite(value).all(), key


def test_nan_refused_step_follows_one_good_step_of_plain_pytorch(
    results: dict[int, dict[str, str]], weights_after_nan: dict[str, dict[str, dict[str, torch.Tensor]]]
) -> None:
    """After the refused step, the fp32 ZeRO-2 run holds the weights of one good GAN step of plain PyTorch."""
    expected = patterns.reference("gan_zero_first", "sgd", 1)
    weights = weights_after_nan["zero2"]["after"]
    for key, value in expected.items():
        assert torch.allclose(weights[key], value, atol=1e-5), key
