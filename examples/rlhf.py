"""RLHF-style PPO with four engines: a trained actor and critic, a frozen reference and reward model.

Run it through the CLI on 2 CPU processes (Lightning starts the second one)::

    lightning-multids fit --config configs/rlhf.yaml

The task is small on purpose. Prompts are single digits; the actor, a Hugging Face GPT-2 over the tokens 0-9
(built from a config: 2 blocks), continues each prompt with ``response_length`` sampled tokens. The reward
model scores a sequence by how often a token is followed by its successor modulo 10 (:class:`CountingReward`),
so the best policy counts upward from the prompt: ``3 -> 4 5 6 7 8 9 0 1``. A random policy scores about 0.1,
counting scores 1.

The critic is a GPT-2 of the same size with one output per token (``GPT2ForTokenClassification``): the value after
each prefix. The actor trains under ZeRO-3 and the critic under ZeRO-1; the reference (a copy of the actor's
initial weights) and the reward model are frozen engines partitioned at ZeRO-3 (``configs/ds/``). Each training
step samples a batch of responses, scores them, and runs ``ppo_epochs`` clipped-surrogate updates of the actor and
value updates of the critic. The actor generates inside ``strategy.gathered("actor")``: gathered once per rollout
instead of layer by layer for every token; on a GPU the critic's states are off it meanwhile
(``strategy.offloaded("critic")``). Each validation epoch logs the mean reward of sampled and of greedy responses
to held-out prompts, and writes a few greedy responses to TensorBoard.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2ForTokenClassification, GPT2LMHeadModel

VOCAB = 10


def gpt2_config(hidden: int) -> GPT2Config:
    """A GPT-2 of 2 blocks of width ``hidden`` over the tokens 0-9, without dropout; no token is padding."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=hidden,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        num_labels=1,
    )


def log_probs(policy: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (B x T-1) of ``sequences[:, 1:]`` under ``policy``, each given the tokens before it."""
    logits = policy(input_ids=sequences[:, :-1]).logits
    return logits.log_softmax(-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def sample(policy: nn.Module, prompts: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
    """Continue each prompt token (B) by ``length`` tokens sampled from ``policy`` with ``generator``: B x 1+length.

    A loop of its own rather than ``generate(do_sample=True)``, which draws from torch's global generator: the
    draws here are the same on every replay of a step (a resumed run's included).
    """
    sequences = prompts[:, None]
    for _ in range(length):
        probabilities = policy(input_ids=sequences).logits[:, -1].softmax(-1)
        sequences = torch.cat([sequences, torch.multinomial(probabilities, 1, generator=generator)], 1)
    return sequences


def greedy(policy: GPT2LMHeadModel, prompts: torch.Tensor, length: int) -> torch.Tensor:
    """Continue each prompt token (B) by ``length`` greedy tokens (Hugging Face's ``generate``): B x 1+length."""
    return policy.generate(prompts[:, None], max_new_tokens=length, do_sample=False)


def values(critic: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The critic's expected return (B x T) after each prefix of ``tokens`` (B x T): one output per token."""
    return critic(input_ids=tokens).logits.squeeze(-1)


class CountingReward(nn.Module):
    """A reward model with one 10 x 10 parameter ``W``, a preference for each transition between tokens.

    The reward of a sequence t_0 .. t_L is the mean over its adjacent pairs of ``onehot(t_i)^T W onehot(t_i+1)``.
    ``W`` starts as the successor permutation (``W[i, (i + 1) % 10] = 1``, else 0), so the reward is the
    fraction of steps that count up by one modulo 10: 1 for ``7 8 9 0 1``, about 0.1 for random tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.preference = nn.Parameter(torch.roll(torch.eye(VOCAB), shifts=1, dims=1))

    def forward(self, sequences: torch.Tensor) -> torch.Tensor:
        """The reward (B) of each sequence (B x T)."""
        onehot = F.one_hot(sequences, VOCAB).to(self.preference.dtype)
        pairs = torch.einsum("bti,ij,btj->bt", onehot[:, :-1], self.preference, onehot[:, 1:])
        return pairs.mean(1)


@dataclass
class Rollout:
    """One batch of sampled responses and what PPO needs of them (all ``B x L`` but ``reward`` and ``kl``)."""

    sequences: torch.Tensor
    """The prompts and their responses (B x 1+L)."""
    log_probs: torch.Tensor
    """The log-probability of each response token under the actor that sampled it."""
    advantages: torch.Tensor
    """GAE advantages, normalised over the batch."""
    returns: torch.Tensor
    """The critic's targets: advantages (before normalising) plus the values."""
    reward: torch.Tensor
    """The reward model's score of each sequence (B)."""
    kl: torch.Tensor
    """The estimated KL from the reference of each response, summed over its tokens (B)."""


class CountingPPO(pl.LightningModule):
    """PPO against a frozen reward model, with a KL penalty towards a frozen reference policy.

    Four submodules, two optimizers: ``actor`` and ``critic`` get trainable engines from
    ``configure_optimizers``; ``reference`` and ``reward`` have no optimizer and become frozen engines
    through their entries in the strategy's ``engines``. The reward of a response is the reward model's
    score, given at its last token, minus ``kl_coef`` times ``log p_actor - log p_reference`` at every token.

    Args:
        hidden: the width of the actor's and the critic's GPT-2.
        response_length: how many tokens the actor generates after each prompt.
        ppo_epochs: how many actor and critic updates each sampled batch gets.
        actor_lr: Adam's learning rate for the actor.
        critic_lr: Adam's learning rate for the critic.
        kl_coef: the weight of the per-token KL penalty towards the reference.
        clip_range: PPO's clipping of the probability ratio, ``1 +- clip_range``.
        gae_lambda: the lambda of generalised advantage estimation (the discount is 1).
        num_samples: how many greedy responses each validation epoch writes to TensorBoard.
    """

    def __init__(
        self,
        hidden: int = 64,
        response_length: int = 8,
        ppo_epochs: int = 4,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        kl_coef: float = 0.02,
        clip_range: float = 0.2,
        gae_lambda: float = 0.95,
        num_samples: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.actor = GPT2LMHeadModel(gpt2_config(hidden))
        self.critic = GPT2ForTokenClassification(gpt2_config(hidden))  # a value per token
        self.reference = copy.deepcopy(self.actor)
        self.reward = CountingReward()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (prompts,) = batch
        opt_actor, opt_critic = self.optimizers()
        generator = seeded(self.device, 0, self.current_epoch, batch_idx, self.global_rank)
        rollout = self.rollout(prompts, generator)
        for _ in range(self.hparams.ppo_epochs):
            actor_loss = self.actor_loss(rollout)
            opt_actor.zero_grad()
            self.manual_backward(actor_loss)
            opt_actor.step()

            critic_loss = self.critic_loss(rollout)
            opt_critic.zero_grad()
            self.manual_backward(critic_loss)
            opt_critic.step()

        metrics = {
            "train/reward": rollout.reward.mean(),
            "train/kl": rollout.kl.mean(),
            "train/actor_loss": actor_loss,
            "train/critic_loss": critic_loss,
        }
        self.log_dict(metrics, prog_bar=True, sync_dist=True)

    @torch.no_grad()
    def rollout(self, prompts: torch.Tensor, generator: torch.Generator) -> Rollout:
        """Sample responses to ``prompts`` and score them with all four submodules."""
        strategy = self.trainer.strategy
        # On a GPU the critic's optimizer states and weights leave it while the actor, gathered once, generates. On a
        # CPU they are in host memory already, and the move would cost 0.8 s per step (a garbage collection among it).
        asleep = strategy.offloaded("critic") if self.device.type == "cuda" else contextlib.nullcontext()
        with asleep, strategy.gathered("actor") as actor:
            sequences = sample(actor, prompts, self.hparams.response_length, generator)
            actor_log_probs = log_probs(actor, sequences)
        kl = actor_log_probs - log_probs(self.reference, sequences)
        critic_values = values(self.critic, sequences[:, :-1])
        reward = self.reward(sequences)
        rewards = -self.hparams.kl_coef * kl
        rewards[:, -1] += reward
        advantages = gae(rewards, critic_values, self.hparams.gae_lambda)
        returns = advantages + critic_values
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        return Rollout(sequences, actor_log_probs, advantages, returns, reward, kl.sum(1))

    def actor_loss(self, rollout: Rollout) -> torch.Tensor:
        """PPO's clipped surrogate loss of the actor on ``rollout``."""
        ratio = (log_probs(self.actor, rollout.sequences) - rollout.log_probs).exp()
        clipped = ratio.clamp(1 - self.hparams.clip_range, 1 + self.hparams.clip_range)
        return -torch.min(ratio * rollout.advantages, clipped * rollout.advantages).mean()

    def critic_loss(self, rollout: Rollout) -> torch.Tensor:
        """The critic's squared error against the returns of ``rollout``."""
        return 0.5 * F.mse_loss(values(self.critic, rollout.sequences[:, :-1]), rollout.returns)

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (prompts,) = batch
        length = self.hparams.response_length
        generator = seeded(self.device, 1, batch_idx, self.global_rank)  # the same draws every epoch
        with self.trainer.strategy.gathered("actor") as actor:
            sampled = sample(actor, prompts, length, generator)
            best = greedy(actor, prompts, length)
        rewards = {"val/reward": self.reward(sampled).mean(), "val/greedy_reward": self.reward(best).mean()}
        self.log_dict(rewards, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        prompts = torch.arange(self.hparams.num_samples, device=self.device) % VOCAB
        with self.trainer.strategy.gathered("actor") as actor:
            best = greedy(actor, prompts, self.hparams.response_length)
        if self.trainer.is_global_zero and isinstance(self.logger, TensorBoardLogger):
            lines = [f"    {s[0]} -> {' '.join(str(t) for t in s[1:])}" for s in best.tolist()]
            self.logger.experiment.add_text("greedy_responses", "\n".join(lines), self.global_step)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.actor.parameters(), lr=self.hparams.actor_lr),
            torch.optim.Adam(self.critic.parameters(), lr=self.hparams.critic_lr),
        ]


def gae(rewards: torch.Tensor, values: torch.Tensor, lam: float) -> torch.Tensor:
    """Generalised advantage estimates (B x L) of per-token ``rewards`` and ``values``, undiscounted.

    The state after the last token is terminal (value 0).
    """
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        next_value = values[:, t + 1] if t + 1 < rewards.size(1) else torch.zeros_like(running)
        running = rewards[:, t] + next_value - values[:, t] + lam * running
        advantages[:, t] = running
    return advantages


def seeded(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` seeded from ``keys`` (e.g. epoch, batch, rank): the same draws on every replay."""
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + key) % 2**63
    return torch.Generator(device=device).manual_seed(seed)


class PromptDataModule(pl.LightningDataModule):
    """Prompts as batches of one tensor: a single random digit per sample, drawn once from ``seed``.

    Args:
        num_prompts: how many training prompts.
        num_val_prompts: how many validation prompts.
        batch_size: the batch size per process (one PPO rollout).
        seed: the seed of the prompts (the same on every rank).
    """

    def __init__(self, num_prompts: int = 2048, num_val_prompts: int = 512, batch_size: int = 64, seed: int = 0):
        super().__init__()
        self.num_prompts = num_prompts
        self.num_val_prompts = num_val_prompts
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        prompts = torch.randint(0, VOCAB, (self.num_prompts + self.num_val_prompts,), generator=generator)
        self.train_prompts = TensorDataset(prompts[: self.num_prompts])
        self.val_prompts = TensorDataset(prompts[self.num_prompts :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_prompts, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_prompts, batch_size=self.batch_size)
