"""Loss scales: read from each engine's optimizer, and each engine's gradients at its own scale in one backward."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_multids._compat.deepspeed import loss_scale
from lightning_multids._precision import EnginePrecision, cast_inputs, loss_scaling
from tests.fakes import FakeEngine, routed_engine_set


def fake_engine(module: nn.Module, scale: float | None) -> SimpleNamespace:
    """An engine as the loss-scaling code sees it: fp16 with ``scale``, or bf16/fp32 when ``scale`` is None."""
    return SimpleNamespace(
        module=module, fp16_enabled=lambda: scale is not None, optimizer=SimpleNamespace(loss_scale=scale)
    )


def test_loss_scale_reads_zero_and_stage_0_fp16_optimizers() -> None:
    assert loss_scale(fake_engine(nn.Linear(1, 1), None)) == 1.0
    assert loss_scale(fake_engine(nn.Linear(1, 1), 1024.0)) == 1024.0
    stage0 = SimpleNamespace(fp16_enabled=lambda: True, optimizer=SimpleNamespace(cur_scale=8.0))
    assert loss_scale(stage0) == 8.0  # type: ignore[arg-type]


class ScaledEngine(FakeEngine):
    """A fake engine at an fp16 loss ``scale``, or bf16/fp32 when ``scale`` is None."""

    def __init__(self, name: str, module: nn.Module, scale: float | None) -> None:
        super().__init__(name, module, [])
        self.optimizer = SimpleNamespace(loss_scale=scale)
        self.scale = scale

    def fp16_enabled(self) -> bool:
        return self.scale is not None


def test_each_engine_receives_gradients_at_its_own_loss_scale() -> None:
    """One loss through an fp16 engine (scale 2^16), another fp16 engine (2^10) and a bf16 one (no scale)."""
    torch.manual_seed(0)
    first, second, third, unused = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 3)
    x = torch.randn(5, 3)
    third(second(first(x))).sum().backward()
    modules = dict(zip("abc", (first, second, third), strict=True))
    expected = {name: [p.grad.clone() for p in m.parameters()] for name, m in modules.items()}
    for module in (first, second, third):
        module.zero_grad(set_to_none=True)
    engines = {
        "a": ScaledEngine("a", first, 2.0**16),
        "b": ScaledEngine("b", second, 2.0**10),
        "c": ScaledEngine("c", third, None),
        "d": ScaledEngine("d", unused, 2.0**4),  # not reached: its scale must not set the loss's
    }
    assert loss_scaling({name: loss_scale(e) for name, e in engines.items()})[0] == 2.0**4  # type: ignore[arg-type]
    routed = routed_engine_set(engines)
    with routed.backward(third(second(first(x))).sum()) as scaled:
        scaled.backward()
    for name in "abc":
        own = loss_scale(engines[name])  # type: ignore[arg-type]
        for param, grad in zip(engines[name].module.parameters(), expected[name], strict=True):
            torch.testing.assert_close(param.grad, grad * own)
    # the hooks that scaled each engine's gradients were for that backward only
    assert not any(p._backward_hooks for m in (first, second, third) for p in m.parameters())


@pytest.mark.parametrize("scales", [(None, None), (2.0**8, 2.0**8)], ids=["bf16", "fp16-one-scale"])
def test_a_backward_at_one_loss_scale_does_not_walk_the_graph(
    scales: tuple[float | None, float | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every engine has the same loss scale, what the loss reaches is found as gradients arrive."""

    def walk(*args: object) -> None:
        raise AssertionError("the graph was walked")

    monkeypatch.setattr("lightning_multids._engines.reached_engines", walk)
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(2, 3), nn.Linear(3, 1)
    engines = {"d": ScaledEngine("d", discriminator, scales[1]), "g": ScaledEngine("g", generator, scales[0])}
    routed = routed_engine_set(engines)
    z = torch.randn(4, 2)
    with routed.backward(discriminator(generator(z).detach()).sum()) as scaled:
        scaled.backward()
    assert engines["d"].calls == [("prologue", "d"), ("epilogue", "d")] and not engines["g"].calls
    assert generator.weight.grad is None
    expected = torch.autograd.grad(discriminator(generator(z).detach()).sum(), discriminator.weight)[0]
    torch.testing.assert_close(discriminator.weight.grad, expected * (scales[1] or 1.0))


def test_the_input_cast_hook_casts_floating_inputs_to_the_engine_dtype_and_leaves_the_rest() -> None:
    """Plain tensor arguments (the usual call) and nested or keyword ones: the same casts, nothing else touched."""
    module = nn.Linear(2, 2).to(torch.bfloat16)
    hook = cast_inputs(torch.bfloat16)
    floats, ints, ready = torch.randn(3, 2), torch.arange(3), torch.randn(3, 2, dtype=torch.bfloat16)
    assert hook(module, (ready, ints), {}) is None  # nothing to cast: the inputs as they are
    args, kwargs = hook(module, (floats, ints), {})
    assert args[0].dtype == torch.bfloat16 and torch.equal(args[0], floats.to(torch.bfloat16)) and args[1] is ints
    args, kwargs = hook(module, ([floats, ints],), {"mask": floats, "steps": 2})
    assert args[0][0].dtype == torch.bfloat16 and args[0][1] is ints and kwargs["mask"].dtype == torch.bfloat16
    assert kwargs["steps"] == 2
    parameter = nn.Parameter(torch.randn(2))  # a tensor subclass takes the general way, and is cast as well
    args, _ = hook(module, (parameter,), {})
    assert args[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("flag", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16), ("32-true", None)]
)
def test_the_steps_autocast_what_runs_outside_the_engines_as_lightnings_mixed_precision(
    flag: str, dtype: torch.dtype | None
) -> None:
    """A plain fp32 head fed by a 16-bit engine's output: under DDP's ``MixedPrecision`` it runs autocast."""
    head, features = nn.Linear(3, 1), torch.ones(2, 3, dtype=dtype or torch.float32)
    outputs = []
    plugins = [EnginePrecision(flag, "cpu")]
    if dtype is not None:
        plugins.append(MixedPrecision(flag, "cpu"))  # type: ignore[arg-type]
    for plugin in plugins:
        with plugin.forward_context():
            outputs.append(head(features))
    assert {output.dtype for output in outputs} == {dtype or torch.float32}
