"""EngineSet: a loss that reaches no trainable engine, and a returned loss that no backward used."""

import pytest
import torch

from tests.fakes import engine_set, fake_optimizer
from tests.unit.test_discovery import GAN, owners_of


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
    assert not any(optimizer.has_gradients for optimizer in optimizers)


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
