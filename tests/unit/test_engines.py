"""EngineSet: a loss that reaches no trainable engine, a returned loss that no backward used, each engine's phase."""

import pytest
import torch
from torch import nn

from lightning_multids._optimizer import EngineOptimizer
from lightning_multids._record import Phase, PhaseError
from tests.fakes import FakeEngine, engine_set, fake_optimizer, routed_engine_set
from tests.unit.test_discovery import GAN, owners_of, sgd


def test_loss_reaching_no_trainable_engine_is_refused() -> None:
    gan = GAN()
    engines = engine_set({}, [fake_optimizer("generator"), fake_optimizer("discriminator")], owners_of(gan))
    loss = gan.generator(torch.randn(2, 4)).detach().requires_grad_().sum()
    with (
        pytest.raises(
            ValueError,
            match=r"reaches no trainable engine \('generator', 'discriminator'\).*without `.detach\(\)`",
        ),
        engines.backward(loss) as scaled,
    ):
        scaled.backward()


def test_a_body_that_runs_no_backward_is_not_refused_and_leaves_no_gradients() -> None:
    """A ``LightningModule.backward`` override that skips the backward: the step then has nothing, as under DDP."""
    gan = GAN()
    optimizers = [fake_optimizer("generator"), fake_optimizer("discriminator")]
    engines = engine_set({}, optimizers, owners_of(gan))
    with engines.backward(gan.generator(torch.randn(2, 4)).sum()):
        pass
    assert not any(record.has_gradients for record in engines.records.values())


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


def test_a_step_during_the_backward_and_a_backward_during_the_step_are_refused_and_leave_the_phase() -> None:
    """An optimizer stepped in backward (from a gradient hook), and a backward from a step hook: each engine's phase."""
    calls: list[tuple[str, str]] = []
    generator = nn.Linear(3, 3)
    engines = routed_engine_set({"generator": FakeEngine("generator", generator, calls)})
    record = engines.records["generator"]
    optimizer = EngineOptimizer(record, sgd(*generator.parameters()), [list(generator.parameters())])
    handle = generator.weight.register_post_accumulate_grad_hook(lambda _: optimizer.step())
    loss = generator(torch.randn(2, 3)).sum()
    with (
        pytest.raises(PhaseError, match=r"`opt.step\(\)` of engine 'generator' during a `self.manual_backward.*after"),
        engines.backward(loss) as scaled,
    ):
        scaled.backward()
    handle.remove()
    assert record.phase is Phase.IDLE and not record.has_gradients

    def backward() -> None:
        with engines.backward(generator(torch.randn(2, 3)).sum()) as scaled:
            scaled.backward()

    backward()
    assert record.phase is Phase.IDLE and record.has_gradients
    engine = record.engine
    engine.global_steps, engine.skipped_steps, engine.step = 0, 0, backward  # its step runs a backward
    with pytest.raises(PhaseError, match=r"`self.manual_backward\(...\)` during `opt.step\(\)` of engine 'generator'"):
        optimizer.step()
    assert record.phase is Phase.IDLE and not record.has_gradients  # the refused step cleared its gradients
