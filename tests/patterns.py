"""The training patterns the strategy must get right, written once for Lightning and for plain PyTorch.

Each pattern is a function of the two modules, a batch, two optimizers, a ``backward`` callable and a
``toggle`` context factory; the Lightning module passes ``self.manual_backward`` and
``self.toggled_optimizer``, the reference passes ``loss.backward`` and a ``requires_grad`` switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

PATTERNS = (
    "gan",
    "gan_zero_first",
    "gan_toggle",
    "shared",
    "accumulate",
    "clipped",
    "interrupted",
    "step_interrupted",
    "zero_grad_unreached",
    "reach_alternates",
)
PARTIAL_REACH = ("zero_grad_unreached", "reach_alternates")
"""Patterns whose loss leaves some trained parameters of D without a gradient: at ZeRO-2/3 they need
``find_unused_parameters=True`` (refused without it), as under DDP."""
CLIP = 0.05
CLIPPING = ("clipped", "step_interrupted")

Backward = Callable[[torch.Tensor], None]
Toggle = Callable[[Any], contextlib.AbstractContextManager]


class CheckpointedMLP(nn.Sequential):
    """``Linear, Tanh, Linear`` whose last two layers run under ``torch.utils.checkpoint``.

    The parameter names are those of the plain ``nn.Sequential``, so weights compare key by key.
    """

    def __init__(self, *layers: nn.Module, use_reentrant: bool) -> None:
        super().__init__(*layers)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self[0](x)  # outside the checkpoint, so a reentrant checkpoint sees an input that needs grad
        return torch.utils.checkpoint.checkpoint(
            lambda h: self[2](self[1](h)), hidden, use_reentrant=self.use_reentrant
        )


class WhollyCheckpointedMLP(nn.Sequential):
    """``Linear, Tanh, Linear`` run whole under a reentrant checkpoint: no parameter shows in the graph.

    A reentrant checkpoint whose inputs need no gradient gives none; an extra input that needs one (what
    Hugging Face's ``enable_input_require_grads`` does for reentrant gradient checkpointing) makes the
    recomputation's backward reach every parameter, which the graph before the backward does not show.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchor = torch.ones((), requires_grad=True)
        return torch.utils.checkpoint.checkpoint(
            lambda h, a: super(WhollyCheckpointedMLP, self).forward(h) * a, x, anchor, use_reentrant=True
        )


def make_modules(seed: int = 0, checkpoint: str | None = None) -> tuple[nn.Module, nn.Module]:
    """A small generator (4 -> 6) and discriminator (6 -> 1), the same for a given seed.

    ``checkpoint="reentrant"`` or ``"non_reentrant"`` builds both with activation checkpointing inside;
    ``"hidden"`` runs each whole inside a reentrant checkpoint.
    """
    torch.manual_seed(seed)
    layers_g = (nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))
    layers_d = (nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if checkpoint is None:
        return nn.Sequential(*layers_g), nn.Sequential(*layers_d)
    if checkpoint == "hidden":
        return WhollyCheckpointedMLP(*layers_g), WhollyCheckpointedMLP(*layers_d)
    reentrant = checkpoint == "reentrant"
    return CheckpointedMLP(*layers_g, use_reentrant=reentrant), CheckpointedMLP(*layers_d, use_reentrant=reentrant)


def make_batches(steps: int, global_batch: int = 8, seed: int = 123) -> torch.Tensor:
    """``steps * global_batch`` samples of (real[6], z[4]) concatenated in one tensor per sample."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(steps * global_batch, 10, generator=generator)


def split(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[:, :6], batch[:, 6:]


def gan(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    """D step with D called twice (real, fake.detach()); G step with the loss through D.

    Without toggling, the G step leaves gradients on D that D's next backward accumulates (no zero_grad
    before it), exactly as in PyTorch.
    """
    real, z = split(batch)
    fake = G(z)
    with toggle(opt_d) if toggle else contextlib.nullcontext():
        d_loss = D(real).pow(2).mean() + (D(fake.detach()) - 1).pow(2).mean()
        backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
    with toggle(opt_g) if toggle else contextlib.nullcontext():
        g_loss = (D(G(z)) - 0.5).pow(2).mean()
        backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()


def gan_zero_first(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    """zero_grad before each backward: the gradients G's backward left on D must be discarded."""
    real, z = split(batch)
    opt_d.zero_grad()
    d_loss = D(real).pow(2).mean() + (D(G(z).detach()) - 1).pow(2).mean()
    backward(d_loss)
    opt_d.step()
    opt_g.zero_grad()
    g_loss = (D(G(z)) - 0.5).pow(2).mean()
    backward(g_loss)
    opt_g.step()


def gan_toggle(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    assert toggle is not None
    gan(G, D, batch, opt_g, opt_d, backward, toggle)


def shared(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    """One loss over both engines, one backward, both step."""
    real, z = split(batch)
    loss = (D(G(z)) - 0.3).pow(2).mean() + D(real).pow(2).mean()
    backward(loss)
    opt_g.step()
    opt_d.step()
    opt_g.zero_grad()
    opt_d.zero_grad()


def accumulate(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
    micro_batches: int = 2,
) -> None:
    """User-managed accumulation through chained engines: loss / N, N backwards, then both step."""
    real, z = split(batch)
    for i in range(micro_batches):
        loss = (D(G(z[i::micro_batches])) - 0.3).pow(2).mean() + D(real[i::micro_batches]).pow(2).mean()
        backward(loss / micro_batches)
    opt_g.step()
    opt_d.step()
    opt_g.zero_grad()
    opt_d.zero_grad()


def clipped(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
    clip: Callable[[Any, float], None] | None = None,
) -> None:
    """One loss over both engines; each engine's gradients clipped to global norm ``CLIP`` before its step."""
    assert clip is not None
    real, z = split(batch)
    backward((D(G(z)) - 0.3).pow(2).mean() + D(real).pow(2).mean())
    clip(opt_g, CLIP)
    clip(opt_d, CLIP)
    opt_g.step()
    opt_d.step()
    opt_g.zero_grad()
    opt_d.zero_grad()


class Interrupted(RuntimeError):
    """What a CUDA out-of-memory error in the middle of a backward stands for in the tests."""


def caught(call: Callable[[], object]) -> None:
    """Run ``call``, which must raise :class:`Interrupted`, and catch it as a user catching out-of-memory would."""
    try:
        call()
    except Interrupted:
        return
    raise AssertionError("the simulated failure did not happen")


@contextlib.contextmanager
def fails_midway(module: nn.Module) -> Iterator[None]:
    """Make the next backward through ``module`` (a ``Linear, Tanh, Linear``) raise :class:`Interrupted` midway.

    It raises when the gradient reaches the output of the ``Tanh``: the last layer's weights have their
    gradients by then (autograd accumulates parameter gradients first), the first layer's do not.
    """

    def trap(gradient: torch.Tensor) -> torch.Tensor:
        raise Interrupted("out of memory (simulated)")

    def on_forward(layer: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(trap)

    handle = module[1].register_forward_hook(on_forward)
    try:
        yield
    finally:
        handle.remove()


def interrupted(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    """The gan pattern where each backward first fails midway and is caught, then retried after ``zero_grad``.

    D's backward fails with some of D's gradients in; G's fails after all of D's and some of G's are in.
    """
    real, z = split(batch)

    def d_loss() -> torch.Tensor:
        return D(real).pow(2).mean() + (D(G(z).detach()) - 1).pow(2).mean()

    def g_loss() -> torch.Tensor:
        return (D(G(z)) - 0.5).pow(2).mean()

    for loss, failing, opt in ((d_loss, D, opt_d), (g_loss, G, opt_g)):
        with fails_midway(failing):
            caught(lambda: backward(loss()))  # noqa: B023 (called at once, inside the loop)
        opt_g.zero_grad()
        opt_d.zero_grad()
        backward(loss())
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def fails_in_step() -> Iterator[None]:
    """Make every torch optimizer step in the body raise :class:`Interrupted` before it changes anything."""

    def trap(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        raise Interrupted("out of memory in the optimizer step (simulated)")

    handle = register_optimizer_step_pre_hook(trap)
    try:
        yield
    finally:
        handle.remove()


def step_interrupted(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
    clip: Callable[[Any, float], None] | None = None,
) -> None:
    """The clipped pattern, but D's clipped step fails and G's clipped step is given up before it runs.

    Both are caught; the gradients are cleared, and the retry steps both engines without clipping: the
    clipping asked for before the failure must not reach it.
    """
    assert clip is not None
    real, z = split(batch)

    def loss() -> torch.Tensor:
        fake = G(z)
        return (D(fake) - 0.3).pow(2).mean() + D(real).pow(2).mean() + (fake - real).pow(2).mean()

    backward(loss())
    clip(opt_d, CLIP)
    clip(opt_g, CLIP)
    with fails_in_step():
        caught(opt_d.step)
    opt_g.zero_grad()
    opt_d.zero_grad()
    backward(loss())
    opt_g.step()
    opt_d.step()
    opt_g.zero_grad()
    opt_d.zero_grad()


def zero_grad_unreached(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    """G's loss reaches all of D; ``opt_d.zero_grad()`` discards that; D's loss then reaches only D's first layer.

    D's last layer gets no gradient after the clear, so its step must leave it where it is (as in PyTorch).
    """
    real, z = split(batch)
    backward((D(G(z)) - 0.5).pow(2).mean())
    opt_g.step()
    opt_g.zero_grad()
    opt_d.zero_grad()
    backward(D[0](real).pow(2).mean() + D[0](G(z).detach()).tanh().mean())
    opt_d.step()
    opt_d.zero_grad()


def reach_alternates(
    G: nn.Module,
    D: nn.Module,
    batch: torch.Tensor,
    opt_g: Any,
    opt_d: Any,
    backward: Backward,
    toggle: Toggle | None = None,
) -> None:
    """D's loss reaches all of D at even steps and only D's first layer at odd ones; G trains on its own loss.

    At an odd step D's last layer gets no gradient, so (with SGD) its step must leave it where it is, whatever
    gradient it had at the step before. The step count is kept on D, so it restarts with the modules.
    """
    real, z = split(batch)
    steps_seen = D.__dict__.get("steps_seen", 0)
    D.steps_seen = steps_seen + 1
    head = D if steps_seen % 2 == 0 else D[0]
    backward(head(real).pow(2).mean() + head(G(z).detach()).tanh().mean())
    opt_d.step()
    opt_d.zero_grad()
    backward((G(z) - real).pow(2).mean())
    opt_g.step()
    opt_g.zero_grad()


STEPS: dict[str, Callable[..., None]] = {
    "gan": gan,
    "gan_zero_first": gan_zero_first,
    "gan_toggle": gan_toggle,
    "shared": shared,
    "accumulate": accumulate,
    "clipped": clipped,
    "interrupted": interrupted,
    "step_interrupted": step_interrupted,
    "zero_grad_unreached": zero_grad_unreached,
    "reach_alternates": reach_alternates,
}


def regression_loss(G: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    real, z = split(batch)
    return (G(z) - real).pow(2).mean()


def reference_automatic(steps: int, accumulate: int = 2, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """Plain PyTorch for ``AutomaticModule``: loss / accumulate, step and StepLR(gamma=0.5) every N batches."""
    G, _ = make_modules()
    optimizer = make_optimizer("sgd", G.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = make_batches(steps, global_batch)
    for step in range(steps):
        (regression_loss(G, data[step * global_batch : (step + 1) * global_batch]) / accumulate).backward()
        if (step + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    return {f"generator.{k}": v.detach().float().clone() for k, v in G.state_dict().items()}


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


@contextlib.contextmanager
def _requires_grad_only(trained: nn.Module, others: list[nn.Module]) -> Iterator[None]:
    """Plain-PyTorch toggle: gradients on for ``trained`` only, restored afterwards."""
    saved = {p: p.requires_grad for m in others for p in m.parameters()}
    for p in saved:
        p.requires_grad_(False)
    for p in trained.parameters():
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)


def reference(
    pattern: str, optimizer: str, steps: int, global_batch: int = 8, validate_every: int = 0, fits: int = 1
) -> dict[str, torch.Tensor]:
    """Train ``pattern`` in one process with plain PyTorch on the global batches; return the weights.

    ``validate_every=N``: clear every gradient after each N steps, as Lightning does before it validates
    during fit (``on_validation_model_zero_grad``), which drops what a step left for the next one.
    ``fits=N``: N fits one after the other on the same modules (new optimizers, no gradient carried over).
    """
    G, D = make_modules()
    opt_g, opt_d = make_optimizer(optimizer, G.parameters()), make_optimizer(optimizer, D.parameters())
    owner = {id(opt_g): G, id(opt_d): D}

    def toggle(opt: Any) -> contextlib.AbstractContextManager:
        return _requires_grad_only(owner[id(opt)], [G, D])

    def clip(opt: Any, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(owner[id(opt)].parameters(), max_norm)

    data = make_batches(steps, global_batch)
    for step in range(steps * fits):
        if step and step % steps == 0:  # the next fit
            G.zero_grad()
            D.zero_grad()
            opt_g, opt_d = make_optimizer(optimizer, G.parameters()), make_optimizer(optimizer, D.parameters())
            owner = {id(opt_g): G, id(opt_d): D}
        batch = data[step % steps * global_batch : (step % steps + 1) * global_batch]
        extra = {"clip": clip} if pattern in CLIPPING else {}
        toggled = toggle if pattern == "gan_toggle" else None
        STEPS[pattern](G, D, batch, opt_g, opt_d, lambda loss: loss.backward(), toggled, **extra)
        if validate_every and (step + 1) % validate_every == 0:
            G.zero_grad()
            D.zero_grad()
    return weights(G, D)


def weights(G: nn.Module, D: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"generator.{k}": v.detach().float().clone() for k, v in G.state_dict().items()}
    out.update({f"discriminator.{k}": v.detach().float().clone() for k, v in D.state_dict().items()})
    return out


# ---- distillation and frozen engines -------------------------------------------------------------------


def make_distill_modules(seed: int = 1) -> tuple[nn.Module, nn.Module]:
    """A teacher (with dropout, so eval mode matters) and a smaller student, 6 -> 4."""
    torch.manual_seed(seed)
    teacher = nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    student = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    return teacher, student


def distill_step(
    teacher: nn.Module, student: nn.Module, batch: torch.Tensor, opt: Any, backward: Backward, micro_batches: int = 2
) -> None:
    """User-managed accumulation of 2: match the frozen teacher's outputs, then step."""
    x = batch[:, :6]
    for i in range(micro_batches):
        xi = x[i::micro_batches]
        loss = (student(xi) - teacher(xi)).pow(2).mean() / micro_batches
        backward(loss)
    opt.step()
    opt.zero_grad()


def frozen_middle_step(
    generator: nn.Module, critic: nn.Module, batch: torch.Tensor, opt: Any, backward: Backward
) -> None:
    """The loss flows through a frozen engine into a trained one: loss = critic(G(z))."""
    z = batch[:, 6:]
    backward(critic(generator(z)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def frozen_twice_step(
    generator: nn.Module, critic: nn.Module, batch: torch.Tensor, opt: Any, backward: Backward
) -> None:
    """The frozen critic is called twice in one loss: on G's output (needs a gradient), then on data (does not)."""
    real, z = split(batch)
    backward(critic(generator(z)).pow(2).mean() + critic(real).tanh().mean())
    opt.step()
    opt.zero_grad()


FROZEN_IN_THE_MIDDLE: dict[str, Callable[..., None]] = {
    "frozen_middle": frozen_middle_step,
    "frozen_twice": frozen_twice_step,
}


def reference_distill(case: str, steps: int, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """Plain PyTorch for the frozen-engine cases; returns the trained module's weights."""
    data = make_batches(steps, global_batch)
    if case in FROZEN_IN_THE_MIDDLE:
        trained, _ = make_modules()
        _, frozen = make_modules()
        prefix = "generator"
    else:
        frozen, trained = make_distill_modules()
        prefix = "student"
    frozen.eval().requires_grad_(False)
    opt = make_optimizer("sgd", trained.parameters())
    for step in range(steps):
        batch = data[step * global_batch : (step + 1) * global_batch]
        if case in FROZEN_IN_THE_MIDDLE:
            FROZEN_IN_THE_MIDDLE[case](trained, frozen, batch, opt, lambda loss: loss.backward())
        else:
            distill_step(frozen, trained, batch, opt, lambda loss: loss.backward())
    return {f"{prefix}.{k}": v.detach().float().clone() for k, v in trained.state_dict().items()}
