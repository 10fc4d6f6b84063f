"""Per-rank script: one phase of a resume at another world size, for the EMA GAN with schedulers (Adam).

Usage: run_reshape.py OUT PHASE SPEC [SPEC ...] [--bf16], each SPEC ``SOURCE:AVERAGE`` as in ``run_ema.py``
(the generator's and its EMA engine's ZeRO stages; the discriminator is ZeRO-2), or ``distill:STAGE``: the
distillation of ``run_resume.py``, a frozen ZeRO-3 teacher (saved, ``save_frozen=True``) and a student at STAGE.
PHASE ``first`` trains 1 epoch and saves ``last.ckpt``; ``second`` resumes from it, at whatever world size this
run has, and trains 1 more. The GAN's engines halve their learning rate after each epoch (``StepLR``, stepped by
the module); ``--bf16`` trains in bf16-mixed. Each phase writes OUT.PHASE on rank 0: {spec: {"weights":
consolidated state dict at the end, "optimizer": Adam's moments and fp32 weights per parameter at the end,
"started": the same when training starts after the resume (``second``, GAN only), "lrs": the learning rates at
the end (GAN only)}}.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed import run_ema, run_resume
from tests.distributed.common import AtFitEnd, AtTrainStart, cpu_trainer, finish
from tests.distributed.run_resume import optimizer_state

warnings.filterwarnings("ignore")
DECAY = 0.7


class ScheduledEmaGan(run_ema.EmaGan):
    """The EMA GAN of ``run_ema`` with a ``StepLR(gamma=0.5)`` per optimizer, stepped at each epoch's end."""

    def configure_optimizers(self) -> Any:
        optimizers = super().configure_optimizers()
        return optimizers, [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in optimizers]

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()


def read_optimizers(strategy: MultiDeepSpeedStrategy) -> list[torch.Tensor]:
    return [t for opt in strategy.optimizers for t in optimizer_state(opt.engine)]


def fit(spec: str, epochs: int, root: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    source, average = spec.split(":")
    if source == "distill":
        return run_resume.fit("distill", int(average), epochs, root, ckpt_path=ckpt_path)
    strategy = MultiDeepSpeedStrategy(
        engine_configs={
            "generator": run_ema.zero(source),
            "discriminator": run_ema.zero("2"),
            "generator_ema": run_ema.zero(average),
        },
        ema={"generator_ema": ("generator", DECAY)},
    )
    at_start, at_end = AtTrainStart(read_optimizers), AtFitEnd(read_optimizers)
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        use_distributed_sampler=False,
        callbacks=[
            ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1),
            at_end,
            *([at_start] if ckpt_path else []),
        ],
        default_root_dir=root,
        precision="bf16-mixed" if "--bf16" in sys.argv else "32-true",
    )
    module = ScheduledEmaGan()
    trainer.fit(module, ckpt_path=ckpt_path)
    return {
        "weights": {k: v.float().clone() for k, v in strategy.consolidated_state_dict().items()},
        "optimizer": at_end.value,
        "started": at_start.value,
        "lrs": [opt.param_groups[0]["lr"] for opt in strategy.optimizers],
    }


def main() -> None:
    out, phase, *specs = (arg for arg in sys.argv[1:] if not arg.startswith("--"))
    results = {}
    for spec in specs:
        root = Path(out).parent / spec.replace(":", "-")
        if phase == "first":
            results[spec] = fit(spec, 1, root / "first")
        else:
            results[spec] = fit(spec, 2, root / "second", ckpt_path=str(root / "first" / "last.ckpt"))
    if torch.distributed.get_rank() == 0:
        torch.save(results, f"{out}.{phase}")


if __name__ == "__main__":
    main()
    finish()
