"""GradCache step time and gradient reductions, with and without deferred sync, for K = 1, 4, 16 chunks.

Run on 2 CPU processes from the repository root (``make bench-gradcache`` does this)::

    torchrun --nproc-per-node 2 benchmarks/gradcache.py [--stage 2] [--steps 30] [--rounds 3]

The model is the dual encoder of ``examples/contrastive.py`` made wider; one step encodes 256 pairs per
process in K chunks. For each K it alternates deferred (``no_sync``) and per-chunk sync fits, ``--rounds``
times each, in this one launch; a fit times ``--steps`` steps after ``--warmup`` untimed ones. Reported:
median step time of each, the median of the per-round ratios deferred/per-chunk (min-max), and the
reductions each engine made per step, counted with :class:`lightning_multids.utilities.ReductionCounter`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from common import BARE, StepMeter, summarize

from examples.contrastive import DigitsDualEncoder, Encoder
from examples.digits import IMAGE, DigitsDataModule
from lightning_multids import MultiDeepSpeedStrategy

BATCH = 256


class WideDualEncoder(DigitsDualEncoder):
    """The example's dual encoder with wider encoders, so that communication is a visible part of a step."""

    def __init__(self, hidden: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image_encoder = Encoder(IMAGE, hidden=hidden, dropout=0.0)
        self.profile_encoder = Encoder(16, hidden=hidden, dropout=0.0)


def fit(stage: int, chunks: int, defer: bool, steps: int, warmup: int, hidden: int) -> StepMeter:
    meter = StepMeter(warmup, count=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiDeepSpeedStrategy(stage=stage),
        max_steps=2 * (warmup + steps),  # two optimizers: the step counter moves twice per batch
        limit_val_batches=0,
        **BARE,
        callbacks=[meter],
    )
    module = WideDualEncoder(hidden=hidden, chunk_size=BATCH // chunks, defer_sync=defer)
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=BATCH))
    return meter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--out", default="outputs/bench/gradcache.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for chunks in (1, 4, 16):
        runs: dict[bool, list[list[float]]] = {True: [], False: []}
        reductions = {}
        for _ in range(args.rounds):
            for defer in (True, False):  # A/B alternating in one launch
                meter = fit(args.stage, chunks, defer, args.steps, args.warmup, args.hidden)
                runs[defer].append(meter.times)
                reductions[defer] = meter.reductions[-1]
        summary = summarize(runs[True], runs[False])
        rows.append({"chunks": chunks, **summary, "reductions": reductions[True], "reductions_each": reductions[False]})
    if pl.utilities.rank_zero.rank_zero_only.rank == 0:
        report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nGradCache, ZeRO-{args.stage}, 2 CPU processes, {BATCH} pairs per process per step, hidden {args.hidden}")
    print(
        "| K chunks | deferred sync (ms/step) | sync every chunk (ms/step) | ratio (min-max) | reductions/step/engine |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        deferred = sorted(set(row["reductions"].values()))
        per_chunk = sorted(set(row["reductions_each"].values()))
        print(
            f"| {row['chunks']} | {row['a_ms']:.1f} | {row['b_ms']:.1f} | "
            f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | {deferred} vs {per_chunk} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
