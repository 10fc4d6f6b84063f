"""Per-rank script: run each bad-input scenario through a real 2-rank fit and print the error it raised."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_multids import MultiDeepSpeedStrategy
from tests import patterns
from tests.distributed.common import cpu_trainer, finish, sharded_loader

warnings.filterwarnings("ignore")


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
        return [g, d]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(patterns.make_batches(2), batch_size=4)


def gathers_by_rank(module: GAN, batch: torch.Tensor) -> None:
    """Rank 0 gathers the generator while rank 1 gathers the discriminator."""
    with module.trainer.strategy.gathered(("generator", "discriminator")[module.global_rank]):
        pass


def returns_loss(module: GAN, batch: torch.Tensor) -> torch.Tensor:
    real, z = patterns.split(batch)
    return module.discriminator(module.generator(z)).mean()


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


class WithProbe(GAN):
    """The GAN with a submodule that reuses the discriminator's first layer."""

    def __init__(self, step: Callable[[GAN, torch.Tensor], object] = returns_loss) -> None:
        super().__init__(step)
        self.probe = torch.nn.Sequential(self.discriminator[0])


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
    "no_optimizer": (lambda: GAN(optimizers="none"), {}),
    "spanning_optimizer": (lambda: GAN(optimizers="spanning"), {}),
    "unknown_engine_key": (lambda: GAN(returns_loss), {"engine_configs": {"critic": {}}}),
    "optimizer_in_both": (lambda: GAN(), {"engine_configs": {"discriminator": {"optimizer": {"type": "SGD"}}}}),
    "fp16_on_cpu": (lambda: GAN(), {"engine_configs": {"generator": {"fp16": {"enabled": True}}}}),
    "clip_on_frozen": (
        lambda: GAN(returns_loss, "generator"),
        {"engine_configs": {"discriminator": {"gradient_clipping": 1.0}}},
    ),
    "returned_loss_in_manual": (lambda: GAN(returns_loss), {}),
    "returned_loss_in_user_manual": (lambda: UserManual(skips_odd_batches), {}),
    "accumulate_when_switched": (lambda: GAN(returns_loss), {}),
    "detached_loss": (lambda: GAN(detached_loss), {}),
    "scheduler_stepped_by_user": (
        lambda: GAN(steps_scheduler, "generator"),
        {"engine_configs": {"discriminator": SCHEDULED}},
    ),
    "forced_automatic": (lambda: ForcedAutomatic(returns_loss), {}),
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
    "zero_grad_before_step": (lambda: GAN(clears_before_step), {}),
    "offload_with_torch_optimizer": (
        lambda: GAN(returns_loss, "generator"),
        {"engine_configs": {"generator": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}}},
    ),
    "gathered_differs_by_rank": (lambda: GAN(gathers_by_rank), {"stage": 3}),
    "frozen_without_parameters": (WithHead, {"engine_configs": {"head": {"zero_optimization": {"stage": 3}}}}),
    "ema_of_another_shape": (lambda: GAN(returns_loss, "generator"), {"ema": {"discriminator": ("generator", 0.9)}}),
    "ema_that_is_trained": (lambda: GAN(returns_loss, "generator"), {"ema": {"generator": ("discriminator", 0.9)}}),
    **{f"plain_backward_zero{stage}": (lambda: GAN(plain_backward), {"stage": stage}) for stage in range(4)},
    "autograd_backward": (lambda: GAN(autograd_backward), {"stage": 3}),
    "autograd_grad_allowed": (lambda: GAN(gradients_by_autograd_grad), {"stage": 2}),
    "penalty_through_zero3": (lambda: GAN(penalty_only), {"stage": 3}),
    "uneven_reach_zero3": (
        lambda: GAN(reaches_on_rank_zero_only),
        {"stage": 1, "engine_configs": {"discriminator": {"zero_optimization": {"stage": 3}}}},
    ),
    **{f"full_gradients_in_no_sync_zero{s}": (lambda: GAN(reads_inside_no_sync), {"stage": s}) for s in (2, 3)},
}


TRAINER_KWARGS: dict[str, dict] = {
    "accumulate_when_switched": {"accumulate_grad_batches": 2},
    "optimizer_state_dict_zero0_bf16": {"precision": "bf16-mixed"},
}


def main() -> None:
    for name, (make_module, kwargs) in SCENARIOS.items():
        options = TRAINER_KWARGS.get(name, {})
        trainer = cpu_trainer(MultiDeepSpeedStrategy(**kwargs), enable_checkpointing=False, **options)
        try:
            trainer.fit(make_module())
        except (ValueError, RuntimeError) as err:
            print(f"RESULT {name}: {err}".replace("\n", " "), flush=True)
        else:
            print(f"RESULT {name}: no error", flush=True)
    for name in NAN_RUNS:
        nan_run(name, sys.argv[1])


NAN_RUNS: dict[str, tuple[int, str, dict]] = {
    # name: (stage, Trainer precision, discriminator's DeepSpeed config). Each is a different place that
    # refuses the step: the torch optimizer's pre-hook (stage 0, fp32), BF16_Optimizer's norm (stage 0, bf16),
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
            self.weights = trainer.strategy.consolidated_state_dict()


def nan_run(name: str, out: str) -> None:
    """A NaN reaches the discriminator on one rank: every rank refuses that step; no weights change."""
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
        print(f"RESULT nan_{name}: {err}".replace("\n", " "), flush=True)
    weights = trainer.strategy.consolidated_state_dict()
    if trainer.global_rank == 0:
        torch.save({"before": before.weights, "after": weights}, Path(out) / f"{name}.pt")


if __name__ == "__main__":
    main()
    finish()
