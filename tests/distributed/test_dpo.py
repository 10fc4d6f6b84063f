"""The DPO example (``examples/dpo.py``) on 2 ranks trains the same weights as plain PyTorch on the same global batch.

The rank code, :func:`fit_each`, trains the example's own :class:`~examples.dpo.DPO` module (small: one block of
32, prompts and responses of 8 bytes of the corpus) for a few steps: the LoRA policy at ZeRO-2 and ZeRO-3, the
frozen reference at ZeRO-3 with ``offload_param``, with SGD (a gradient-scale error shows) and AdamW (optimizer
state matters). :func:`plain` trains the same module in one process, with DPO's loss written out here from the
paper's formula, on each step's global batch (both ranks' rows). Each rank returns the consolidated weights
and its losses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.dpo import DPO, preference_pairs  # noqa: E402
from examples.text import corpus  # noqa: E402
from lightning_multids import MultiDeepSpeedStrategy  # noqa: E402
from tests.distributed.common import cpu_trainer, sharded_loader  # noqa: E402
from tests.distributed.harness import on_ranks  # noqa: E402

STEPS, PER_RANK, PROMPT, RESPONSE, BETA = 3, 4, 8, 8, 0.5
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.5), "adamw": lambda params: torch.optim.AdamW(params)}
STAGES = (2, 3)
TOLERANCE = 1e-5


def pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) for every step: STEPS x 2 x PER_RANK pairs of the corpus, in order."""
    chosen, rejected = preference_pairs(corpus()[0][:20_000], PROMPT, RESPONSE, seed=0)
    rows = STEPS * 2 * PER_RANK
    return chosen[:rows], rejected[:rows]


class SmallDPO(DPO):
    """The example's module, small, from the same random weights and adapters everywhere, with ``optimizer``."""

    def __init__(self, optimizer: str) -> None:
        torch.manual_seed(0)
        super().__init__(layers=1, width=32, heads=2, prompt=PROMPT, lora_rank=4, beta=BETA)
        self.optimizer = optimizer
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.manual_seed(1)  # the adapters' initial weights
        super().setup(stage)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        chosen, rejected = batch.unbind(1)
        loss = super().training_step((chosen, rejected), batch_idx)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer]([p for p in self.policy.parameters() if p.requires_grad])

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, torch.stack(pairs(), 1), batch_size=PER_RANK)  # rows of (chosen, rejected)

    def on_train_end(self) -> None:
        pass  # no generated lines


def strategy(stage: int) -> MultiDeepSpeedStrategy:
    reference = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"}}
    return MultiDeepSpeedStrategy(
        engine_configs={
            "policy": {"zero_optimization": {"stage": stage}},
            "reference": {"zero_optimization": reference},
        }
    )


def fit_each() -> dict[tuple[int, str], dict[str, Any]]:
    """On each rank: the example trained at each policy stage with each optimizer; its weights and losses."""
    results = {}
    for stage in STAGES:
        for optimizer in OPTIMIZERS:
            module = SmallDPO(optimizer)
            trainer = cpu_trainer(
                strategy(stage),
                max_steps=STEPS,
                limit_val_batches=0,
                use_distributed_sampler=False,
                enable_checkpointing=False,
            )
            trainer.fit(module)
            weights = trainer.strategy.consolidated_state_dict()
            results[(stage, optimizer)] = {
                "weights": {key: value.detach().float().clone() for key, value in weights.items()},
                "losses": module.losses,
            }
    return results


def log_probs(model: torch.nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """log pi(response | prompt) of each sequence: the response's next-token log-probabilities, summed."""
    logits = model(input_ids=sequences).logits
    per_token = torch.log_softmax(logits[:, :-1], -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
    return per_token[:, PROMPT - 1 :].sum(-1)


def plain(optimizer: str) -> dict[str, Any]:
    """The same module in one process; DPO's loss (Rafailov et al. 2023, eq. 7) on each step's global batch."""
    module = SmallDPO(optimizer)
    module.setup("fit")
    opt = module.configure_optimizers()
    chosen, rejected = pairs()
    losses = []
    for step in range(STEPS):
        rows = slice(step * 2 * PER_RANK, (step + 1) * 2 * PER_RANK)
        with torch.no_grad():
            reference_chosen = log_probs(module.reference, chosen[rows])
            reference_rejected = log_probs(module.reference, rejected[rows])
        chosen_ratio = log_probs(module.policy, chosen[rows]) - reference_chosen
        rejected_ratio = log_probs(module.policy, rejected[rows]) - reference_rejected
        loss = -F.logsigmoid(BETA * (chosen_ratio - rejected_ratio)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"weights": {key: value.detach().float() for key, value in module.state_dict().items()}, "losses": losses}


@pytest.fixture(scope="module")
def results() -> dict[tuple[int, str], dict[str, Any]]:
    """Rank 0's weights; each step's loss as the mean of both ranks' (each rank's is over its half of the batch)."""
    first, second = on_ranks(fit_each, timeout=600)
    for key, run in first.items():
        run["losses"] = [(a + b) / 2 for a, b in zip(run["losses"], second[key]["losses"], strict=True)]
    return first


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("stage", STAGES)
def test_dpo_trains_the_weights_plain_pytorch_trains(results: dict, stage: int, optimizer: str) -> None:
    ours, expected = results[(stage, optimizer)], plain(optimizer)
    assert ours["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
    adapters = [key for key in expected["weights"] if "lora_" in key]
    assert adapters, "the policy has no LoRA adapters"
    assert ours["weights"].keys() == expected["weights"].keys()
    for key, weight in expected["weights"].items():
        diff = (ours["weights"][key] - weight).abs().max().item()
        assert diff <= TOLERANCE, f"ZeRO-{stage}, {optimizer}: {key} differs from plain PyTorch by {diff:.2e}"
    moved = [key for key in adapters if key.endswith("lora_B.default.weight") and ours["weights"][key].abs().max() > 0]
    assert moved, "the adapters did not train"
    start = SmallDPO(optimizer)
    start.setup("fit")
    frozen = {key: value for key, value in start.state_dict().items() if key.startswith("reference.")}
    assert all(torch.equal(ours["weights"][key], value) for key, value in frozen.items()), "the reference moved"


def fit_then_validate(lora_rank: int) -> tuple[dict[str, float], dict[str, float]]:
    """One process: the example's module fitted an epoch (the reference at ZeRO-3), then validated by its trainer."""
    module = SmallDPO("sgd")
    module.hparams.lora_rank = lora_rank
    held_out = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*pairs()), batch_size=2 * PER_RANK)
    module.val_dataloader = lambda: held_out  # type: ignore[method-assign]
    module.validation_step = lambda batch, batch_idx: DPO.validation_step(module, batch, batch_idx)  # type: ignore[method-assign]
    trainer = cpu_trainer(
        strategy(2), max_epochs=1, num_sanity_val_steps=0, use_distributed_sampler=False, enable_checkpointing=False
    )
    trainer.fit(module)
    after_fit = {key: value.item() for key, value in trainer.callback_metrics.items() if key.startswith("val/")}
    (validated,) = trainer.validate(module, verbose=False)
    return after_fit, validated


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_validate_after_fit_keeps_what_fit_trained(lora_rank: int) -> None:
    """``setup`` runs once: a second one reloaded the starting weights, into a reference ZeRO-3 had partitioned."""
    after_fit, validated = on_ranks(fit_then_validate, lora_rank, world_size=1, timeout=300)[0]
    assert after_fit and validated == pytest.approx(after_fit)
