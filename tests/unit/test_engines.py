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
