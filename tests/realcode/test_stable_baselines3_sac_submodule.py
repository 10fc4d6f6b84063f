"""stable-baselines3==2.9.2: SAC's gradient step as in ``test_stable_baselines3_sac``, with ``log_ent_coef`` moved
into a submodule of its own, as the strategy's refusal of a parameter of the LightningModule itself says to do.

The same ``SAC.train`` step on the same ``SACPolicy`` pieces and optimizers; only where the coefficient lives
differs: ``self.entropy.log_ent_coef`` (a module holding the one parameter, no ``forward``) instead of
``self.log_ent_coef``. The coefficient is then read outside any forward of its holder, the class of use ZeRO-3
partitions away (issue 67).

Findings: at ZeRO-3, ``polyak_update`` of the critics is refused at its first read of their ``param.data`` (with
the fix in the error); with the coefficient's holder at ZeRO-3 (the ``mixed`` setup) the coefficient is an empty
tensor in ``training_step``, ``(log_prob + target).detach() * log_ent_coef`` broadcasts to an empty loss, and the fit
runs to its end with every weight wrong and no error: the issue's class, silent here rather than an ``IndexError``.
"""

from __future__ import annotations

import pytest
from torch import nn

from tests.realcode.harness import Case, Launched, assert_matches_ddp, setups
from tests.realcode.test_stable_baselines3_sac import SAC


class EntropyCoefficient(nn.Module):
    """Holds SB3's ``log_ent_coef``."""

    def __init__(self, log_ent_coef: nn.Parameter) -> None:
        super().__init__()
        self.log_ent_coef = log_ent_coef


class SACWithEntropyModule(SAC):
    def hold_log_ent_coef(self, log_ent_coef: nn.Parameter) -> None:
        self.entropy = EntropyCoefficient(log_ent_coef)

    def log_ent_coef_parameter(self) -> nn.Parameter:
        return self.entropy.log_ent_coef


CASE = Case(
    build=SACWithEntropyModule,
    # the actor and the coefficient partitioned, the critics at ZeRO-2 (where polyak_update reads them), the target
    # critics a frozen engine; without "entropy": 3 this setup matches DDP bit for bit (tried)
    mixed={"actor": 3, "entropy": 3, "critic_target": 0},
    find_unused=True,  # the entropy loss reaches the coefficient alone, the critics' loss the critics alone
    ci=("zero2", "zero3", "mixed"),  # zero3 and mixed are expected to fail: zero2 is what CI compares
    xfail={
        "zero3": "refused at the first polyak_update: it reads `param.data` of the ZeRO-3 critics outside their "
        "forward (the error names `gathered` and `ema=`)",
        "mixed": "silently wrong: log_ent_coef, read outside its holder's forward, is an empty ZeRO-3 partition "
        "(shape (0,)) that the losses broadcast without an error; every weight off by up to 0.03, no error",
    },
)


@pytest.mark.parametrize("setup", setups(CASE))
def test_matches_ddp(setup: str, launched: Launched) -> None:
    assert_matches_ddp(launched, setup)
