"""Distilling a byte-level causal language model: a frozen ZeRO-3 teacher, a student half its size, and a control.

Two runs, each a YAML in ``configs/``, on the standard library's docstrings (:mod:`examples.text`)::

    lightning-multids fit --config configs/lm_distill_teacher.yaml   # the teacher (4 blocks), on its own
    lightning-multids fit --config configs/lm_distill.yaml           # two students (2 blocks) beside it

The second run trains two students of the same initial weights on the same batches: ``student`` learns from the
text and from the frozen teacher's softened next-byte distributions, ``alone`` from the text only. Three engines:
the teacher frozen and partitioned (ZeRO-3), the students under ZeRO-2, each with its own AdamW and schedule.
Each run ends by printing held-out perplexity and a few greedy continuations (generated inside
``strategy.gathered``); validation logs them to TensorBoard.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from peft import LoraConfig, get_peft_model
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR
from torchmetrics.text import Perplexity

from examples.text import decode, encode, gpt2, next_token_loss
from lightning_multids.checkpoint import consolidated_state_dicts

PROMPTS = ["Return the ", "If the file ", "This module provides "]
"""What each run's generated lines continue."""


def adamw(parameters: list[torch.nn.Parameter], lr: float, steps: float) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW and a one-cycle schedule over ``steps`` (warm-up, then cosine decay): the trainer's estimate."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    return optimizer, OneCycleLR(optimizer, max_lr=lr, total_steps=max(int(steps), 1), pct_start=0.1)


def continuations(module: pl.LightningModule, name: str, length: int) -> list[str]:
    """Greedy continuations of :data:`PROMPTS` by submodule ``name``, made whole once (``strategy.gathered``).

    A collective: every rank calls it.
    """
    lines = []
    with module.trainer.strategy.gathered(name) as model:
        for prompt in PROMPTS:
            tokens = encode(prompt)[None].to(module.device)
            generated = model.generate(tokens, max_new_tokens=length, do_sample=False)
            lines.append(repr(decode(generated[0]).split("\n\n")[0]))
    return lines


def log_text(module: pl.LightningModule, tag: str, lines: list[str]) -> None:
    """Write ``lines`` to TensorBoard (rank 0) as text at this step."""
    if module.trainer.is_global_zero and isinstance(module.logger, TensorBoardLogger):
        module.logger.experiment.add_text(tag, "\n".join(f"    {line}" for line in lines), module.global_step)


class CausalLM(pl.LightningModule):
    """One byte-level GPT-2 trained on the text: the teacher. One optimizer: Lightning's automatic optimization.

    Args:
        layers: transformer blocks.
        width: the embedding width.
        heads: attention heads.
        lr: AdamW's peak learning rate (one cycle over the run).
        generate: bytes each generated line adds to its prompt.
    """

    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, lr: float = 3e-3, generate: int = 48):
        super().__init__()
        self.save_hyperparameters()
        self.model = gpt2(layers, width, heads)
        self.val_perplexity = Perplexity()
        self.run_summary: dict[str, str] = {}  # extra lines for lightning_multids.utilities.RunSummary

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = next_token_loss(self.model(input_ids=tokens).logits, tokens)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        self.val_perplexity(self.model(input_ids=tokens).logits[:, :-1], tokens[:, 1:])
        self.log("val/perplexity", self.val_perplexity, prog_bar=True)

    def on_train_end(self) -> None:
        lines = continuations(self, "model", self.hparams.generate)
        log_text(self, "generated", lines)
        perplexity = self.trainer.callback_metrics.get("val/perplexity")
        if perplexity is not None:
            self.run_summary["Held-out perplexity"] = f"{perplexity.item():.3f} (per byte)"
        self.run_summary["Generated"] = "  ".join(lines)

    def configure_optimizers(self) -> dict:
        optimizer, schedule = adamw(
            list(self.model.parameters()), self.hparams.lr, self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


TEACHER_FIRST = "Train the teacher first: `lightning-multids fit --config configs/lm_distill_teacher.yaml` writes it."
STUDENT_FIRST = "Distill the student first: `lightning-multids fit --config configs/lm_distill.yaml` writes it."


def require_checkpoint(path: str | None, remedy: str) -> None:
    """Raise ``FileNotFoundError`` saying ``remedy`` if there is no checkpoint at ``path`` (None: none is asked for).

    Called when the module is built, so that the command stops before its ranks start.
    """
    if path is not None and not Path(path).exists():
        raise FileNotFoundError(f"The checkpoint {path!r} does not exist. {remedy}")


def checkpoint_weights(path: str, engine: str, remedy: str) -> dict[str, torch.Tensor]:
    """The whole weights of ``engine`` in the checkpoint at ``path``; if there is none, an error saying ``remedy``."""
    require_checkpoint(path, remedy)
    weights = consolidated_state_dicts(Path(path))
    if engine not in weights:
        raise KeyError(f"The checkpoint {path!r} has no engine {engine!r}; it has {sorted(weights)}.")
    return weights[engine]


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with LoRA adapters of ``rank`` on its attention and feed-forward projections (PEFT), as they start.

    The adapters start as a no-op (LoRA's B is zero); only they train. Their A comes from torch's generator: the
    same seed gives the same adapters.
    """
    adapters = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=["c_attn", "c_fc"],
        fan_in_fan_out=True,  # GPT-2's projections are Conv1D layers
    )
    with warnings.catch_warnings():  # peft 0.21 reads an attribute that transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return get_peft_model(model, adapters)


class LMDistillation(pl.LightningModule):
    """Two students of the same initial weights on the same batches, one of them also learning from a frozen teacher.

    ``student``'s loss is ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * LM`` per next byte, with both
    distributions softened by temperature ``T`` (Hinton et al., 2015); ``alone``'s is the LM loss only. The teacher
    (no optimizer) becomes a frozen engine through its entry in the strategy's ``engine_configs``; its weights come
    from the checkpoint of a :class:`CausalLM` run (its ``model`` engine).

    Args:
        teacher_checkpoint: the checkpoint directory of the teacher's run; None to build the module without the
            teacher's weights (``load_from_checkpoint`` of a student, the teacher not needed).
        teacher_layers: the teacher's blocks, as in that run.
        student_layers: each student's blocks.
        width: the embedding width of all three.
        heads: attention heads of all three.
        temperature: the softening ``T``.
        alpha: the weight of the teacher's term.
        lr: AdamW's peak learning rate of each student (one cycle over the run).
        generate: bytes each generated line adds to its prompt.
        student_checkpoint: a checkpoint directory whose engine ``student_engine`` both students start from (for
            example this run's own, to distill further); without one they start from the same random weights.
        student_engine: that checkpoint's engine (``student`` in this run's checkpoints, ``model`` in the
            teacher's).
        lora_rank: with a rank above 0, both students train LoRA adapters on their attention and feed-forward
            projections and their own weights stay as they started (meant with ``student_checkpoint``).
    """

    def __init__(
        self,
        teacher_checkpoint: str | None,
        teacher_layers: int = 4,
        student_layers: int = 2,
        width: int = 128,
        heads: int = 4,
        temperature: float = 1.0,
        alpha: float = 0.9,
        lr: float = 3e-3,
        generate: int = 48,
        student_checkpoint: str | None = None,
        student_engine: str = "student",
        lora_rank: int = 0,
    ) -> None:
        super().__init__()
        require_checkpoint(teacher_checkpoint, TEACHER_FIRST)
        require_checkpoint(student_checkpoint, STUDENT_FIRST)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.teacher = gpt2(teacher_layers, width, heads)
        self.student = gpt2(student_layers, width, heads)
        self.alone = copy.deepcopy(self.student)  # the control: the same start, the same batches, no teacher
        self.perplexity = torch.nn.ModuleDict({name: Perplexity() for name in ("teacher", "student", "alone")})
        self.run_summary: dict[str, str] = {}
        self.started = False

    def setup(self, stage: str) -> None:
        """Load the teacher's (and the students') weights on every rank, and add adapters, before the engines exist.

        Once: a later ``validate`` of the same module keeps what ``fit`` trained (and the ZeRO-3 teacher stays
        partitioned after ``fit``, so it cannot load whole weights again).
        """
        if self.started:
            return
        self.started = True
        if self.hparams.teacher_checkpoint is not None:
            self.teacher.load_state_dict(checkpoint_weights(self.hparams.teacher_checkpoint, "model", TEACHER_FIRST))
        if self.hparams.student_checkpoint is not None:
            weights = checkpoint_weights(self.hparams.student_checkpoint, self.hparams.student_engine, STUDENT_FIRST)
            self.student.load_state_dict(weights)
            self.alone.load_state_dict(weights)
        if self.hparams.lora_rank:
            rank = self.hparams.lora_rank
            self.student, self.alone = with_lora(self.student, rank), with_lora(self.alone, rank)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        t, alpha = self.hparams.temperature, self.hparams.alpha
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=tokens).logits
        logits = self.student(input_ids=tokens).logits
        soft = F.kl_div(
            F.log_softmax(logits / t, -1).flatten(0, 1),
            F.log_softmax(teacher_logits / t, -1).flatten(0, 1),
            reduction="batchmean",
            log_target=True,
        )
        lm = next_token_loss(logits, tokens)
        alone = next_token_loss(self.alone(input_ids=tokens).logits, tokens)
        for optimizer, scheduler, loss in zip(
            self.optimizers(), self.lr_schedulers(), [alpha * t * t * soft + (1 - alpha) * lm, alone], strict=True
        ):
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            scheduler.step()
        self.log_dict({"train/distill": soft, "train/student_lm": lm, "train/alone_lm": alone}, prog_bar=True)

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        for name, metric in self.perplexity.items():
            metric(getattr(self, name)(input_ids=tokens).logits[:, :-1], tokens[:, 1:])
            self.log(f"val/{name}_perplexity", metric, prog_bar=True)

    def on_train_end(self) -> None:
        metrics = self.trainer.callback_metrics
        if all(f"val/{name}_perplexity" in metrics for name in self.perplexity):
            figures = ", ".join(f"{name} {metrics[f'val/{name}_perplexity'].item():.3f}" for name in self.perplexity)
            self.run_summary["Held-out perplexity"] = f"{figures} (per byte)"
        for name in self.perplexity:
            lines = continuations(self, name, self.hparams.generate)
            log_text(self, f"generated/{name}", lines)
            self.run_summary[f"Generated ({name})"] = "  ".join(lines)

    def configure_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LRScheduler]]:
        steps = self.trainer.estimated_stepping_batches
        trainable = [[p for p in model.parameters() if p.requires_grad] for model in (self.student, self.alone)]
        pairs = [adamw(parameters, self.hparams.lr, steps) for parameters in trainable]
        return [optimizer for optimizer, _ in pairs], [schedule for _, schedule in pairs]
