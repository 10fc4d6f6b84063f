from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_multids._compat.deepspeed import loss_scale
from lightning_multids._discovery import check_engine_names, match_optimizers, parameter_owners, reached_engines
from lightning_multids._optimizer import EngineScheduler, _GroupView
from lightning_multids._precision import loss_scaling
from tests import patterns
from tests.fakes import FakeEngine, engine_set, fake_optimizer, routed_engine_set


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = patterns.make_modules()
        self.scale = nn.Parameter(torch.ones(1))


def sgd(*params: object) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=0.1)  # type: ignore[arg-type]


def test_each_optimizer_is_matched_to_its_submodule_in_order() -> None:
    gan = GAN()
    optimizers = [sgd(*gan.discriminator.parameters()), sgd(*gan.generator.parameters())]
    assert list(match_optimizers(gan, optimizers).items()) == [("discriminator", 0), ("generator", 1)]


def test_optimizer_with_several_param_groups_of_one_submodule() -> None:
    gan = GAN()
    first, *rest = gan.generator.parameters()
    optimizer = torch.optim.SGD([{"params": [first], "lr": 0.1}, {"params": rest, "lr": 0.01}])
    assert match_optimizers(gan, [optimizer]) == {"generator": 0}


def test_optimizer_spanning_two_submodules_is_refused() -> None:
    gan = GAN()
    optimizer = sgd(*gan.generator.parameters(), *gan.discriminator.parameters())
    with pytest.raises(
        ValueError,
        match=r"Optimizer 0 holds parameters of 'generator' and 'discriminator'.*one optimizer per submodule",
    ):
        match_optimizers(gan, [optimizer])


def test_parameter_in_two_optimizers_is_refused() -> None:
    gan = GAN()
    shared = next(gan.generator.parameters())
    optimizers = [sgd(*gan.generator.parameters()), sgd(shared)]
    with pytest.raises(
        ValueError, match=r"parameter of 'generator' is in optimizer 0 and optimizer 1.*remove it from one"
    ):
        match_optimizers(gan, optimizers)


def test_parameter_of_the_lightning_module_itself_is_refused() -> None:
    gan = GAN()
    with pytest.raises(ValueError, match=r"belongs to the LightningModule itself.*move the parameter into a submodule"):
        match_optimizers(gan, [sgd(gan.scale)])


def test_two_optimizers_for_one_submodule_are_refused() -> None:
    gan = GAN()
    first, *rest = gan.generator.parameters()
    with pytest.raises(ValueError, match=r"Optimizers 0 and 1 both train 'generator'.*several parameter groups"):
        match_optimizers(gan, [sgd(first), sgd(*rest)])


def test_engines_key_that_is_not_a_submodule_lists_the_submodules() -> None:
    with pytest.raises(
        ValueError, match=r"entry for 'critic'.*no submodule of that name.*'generator', 'discriminator'"
    ):
        check_engine_names(GAN(), ["generator", "critic"])


def test_parameter_owners_skips_the_modules_own_parameters() -> None:
    gan = GAN()
    owners = parameter_owners(gan)
    assert id(gan.scale) not in owners
    assert {owners[id(p)] for p in gan.generator.parameters()} == {"generator"}


def owners_of(gan: GAN) -> dict[int, str]:
    return {id(p): name for name in ("generator", "discriminator") for p in getattr(gan, name).parameters()}


def test_reached_engines_follows_the_graph_and_respects_detach() -> None:
    gan = GAN()
    real, z = patterns.split(torch.randn(4, 10))
    fake = gan.generator(z)
    d_loss = gan.discriminator(real).mean() + gan.discriminator(fake.detach()).mean()
    g_loss = gan.discriminator(fake).mean()
    assert reached_engines(d_loss, owners_of(gan)).names == {"discriminator"}
    assert reached_engines(g_loss, owners_of(gan)).names == {"discriminator", "generator"}
    assert reached_engines(gan.generator(z).detach().sum(), owners_of(gan)).names == set()


def test_reached_engines_skips_an_engine_whose_gradients_are_off() -> None:
    gan = GAN()
    gan.discriminator.requires_grad_(False)
    loss = gan.discriminator(gan.generator(torch.randn(2, 4))).sum()
    assert reached_engines(loss, owners_of(gan)).names == {"generator"}


def test_loss_reaching_no_trainable_engine_is_refused() -> None:
    gan = GAN()
    engines = engine_set({}, [fake_optimizer("generator"), fake_optimizer("discriminator")], owners_of(gan))
    loss = gan.generator(torch.randn(2, 4)).detach().requires_grad_().sum()
    with (
        pytest.raises(
            ValueError,
            match=r"reaches no trainable engine \('generator', 'discriminator'\).*without `.detach\(\)`",
        ),
        engines.backward(loss),
    ):
        pass


def test_returned_loss_without_manual_backward_is_refused_only_where_nothing_can_train() -> None:
    engines = engine_set({}, [fake_optimizer("generator")])
    loss = torch.ones(1, requires_grad=True).sum()
    engines.check_loss_was_used({"loss": loss})  # the user chose manual optimization: allowed, as in Lightning
    engines.switched_to_manual = True  # written for the automatic loop, switched by the strategy
    with pytest.raises(
        ValueError, match=r"returned a loss but called no `self.manual_backward`.*manual_backward\(loss\)"
    ):
        engines.check_loss_was_used({"loss": loss})
    engines.check_loss_was_used(loss.detach())  # a logged value is fine
    engines.backward_calls = 1
    engines.check_loss_was_used(loss)  # the module does call manual_backward: a step without it is its choice


def test_group_view_shows_module_parameters_and_writes_hyperparameters_through() -> None:
    params = list(nn.Linear(2, 2).parameters())
    group = {"params": [torch.zeros(6)], "lr": 0.1}
    view = _GroupView(group, params)
    assert view["params"] is params
    view["lr"] = 0.5
    assert group["lr"] == 0.5
    assert set(view) == {"params", "lr"}
    with pytest.raises(ValueError, match=r"fixed when the engine is built.*configure_optimizers"):
        view["params"] = []


def test_engine_scheduler_refuses_a_second_step_and_reads_the_real_one() -> None:
    optimizer = sgd(nn.Parameter(torch.ones(1)))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    visible = EngineScheduler("generator", scheduler)
    assert visible.get_last_lr() == [0.1]
    with pytest.raises(ValueError, match=r"engine 'generator' is stepped by its optimizer.*Remove the"):
        visible.step()


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
    with pytest.raises(RuntimeError, match="backward outside `self.manual_backward` reached .* engine 'c'"):
        third(second(first(x))).sum().backward()  # outside a backward of the set: refused before accumulating
    torch.testing.assert_close(third.bias.grad, expected["c"][-1], rtol=0, atol=0)


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


def test_clipping_by_value_in_manual_optimization_is_refused() -> None:
    from lightning_multids._optimizer import EngineOptimizer
    from lightning_multids._precision import EnginePrecision

    module = nn.Linear(2, 2)
    engine = SimpleNamespace(module=module, fp16_enabled=lambda: False, optimizer=None)
    optimizer = EngineOptimizer("critic", engine, sgd(*module.parameters()), [list(module.parameters())])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"engine 'critic' by value is not available.*gradient_clip_algorithm='norm'"):
        EnginePrecision().clip_gradients(optimizer, 0.5, "value")  # type: ignore[arg-type]
