"""Host-device syncs per step on a GPU: MultiDeepSpeedStrategy (A) against the hand-written DeepSpeed loop (B).

One process on one GPU; every case, stage and precision given runs in that process, A and B one after the other::

    python benchmarks/syncs.py --cases gan distill single --stages 0 1 2 3 --precisions bf16-mixed 16-mixed

The cases are those of ``benchmarks/overhead.py`` (``--size cpu`` models by default: the count does not depend on
the width). After ``--warmup`` steps, every later step of each side runs under
``torch.cuda.set_sync_debug_mode("warn")``, which warns at operations that make the host wait for the GPU
(``.item()``, ``.tolist()``, ``bool(tensor)``, a device-to-host copy...; not ``torch.cuda.synchronize()``, so the
timers' syncs are not counted). Each Python warning is put down to the innermost frame outside torch that led to
it: ``strategy`` (this package), ``deepspeed``, ``lightning``, or ``benchmark`` (the step's own code). Reported:
each origin's syncs per step on each side, and the strategy's call sites. The goal for the strategy's own column
is 0.

What it does not see: syncs that torch reports from C++ without a Python warning (c10d's collectives print
``warn_or_error_on_sync`` to stderr); and one process is one rank, so the strategy's cross-rank agreement after
each backward (world size 1 skips it) is not exercised. A sync inside a C++ backward is put down to the caller of
``backward`` (Lightning's on side A, DeepSpeed's on side B).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import REPO, StepMeter, release_memory, synchronize
from overhead import SIZES, Run, batches, configure, raw_engines, raw_step, release_raw, run_strategy

import lightning_multids

ORIGINS = {
    "strategy": Path(lightning_multids.__file__).parent,
    "benchmark": REPO / "benchmarks",
}
PACKAGES = ("deepspeed", "lightning", "torch")
MESSAGE = r".*synchroniz.*"


def origin(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """The origin of a sync and its call site: the innermost frame that is not torch's or Python's warnings'."""
    for frame in reversed(stack):
        path = Path(frame.filename)
        for name, root in ORIGINS.items():
            if root in path.parents:
                return name, f"{path.relative_to(root.parent)}:{frame.lineno} {frame.name}"
        for package in PACKAGES:
            if f"/{package}/" in frame.filename and package != "torch":
                return package, f"{package}/{frame.filename.split(f'/{package}/')[-1]}:{frame.lineno} {frame.name}"
    return "torch", "(torch only)"


class SyncCounter:
    """Counts the syncs that ``set_sync_debug_mode("warn")`` reports while :attr:`on`, by origin and call site."""

    def __init__(self) -> None:
        self.on = False
        self.origins: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()

    @contextmanager
    def installed(self) -> Iterator[SyncCounter]:
        previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=MESSAGE)
            show = warnings.showwarning

            def record(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
                if not self.on or "synchroniz" not in str(message):
                    return show(message, category, filename, lineno, *args, **kwargs)
                name, site = origin(traceback.extract_stack()[:-1])
                self.origins[name] += 1
                if name == "strategy":
                    self.sites[site] += 1

            warnings.showwarning = record
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode(previous)


class CountingMeter(StepMeter):
    """Counts from the end of the warm-up to the end of the last step (Lightning's work between steps too)."""

    def __init__(self, warmup: int, counter: SyncCounter) -> None:
        super().__init__(warmup)
        self.counter = counter

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, module, *args)
        if self._batches == self.warmup:
            self.counter.on = True

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.counter.on = False


def count_strategy(run: Run, data: list, warmup: int) -> SyncCounter:
    counter = SyncCounter()
    with counter.installed():
        run_strategy(run, data, warmup, CountingMeter(warmup, counter))
    return counter


def count_raw(run: Run, data: list, warmup: int) -> SyncCounter:
    counter = SyncCounter()
    engines = raw_engines(run)
    with counter.installed():
        for index, (real, z) in enumerate(data):
            counter.on = index >= warmup
            raw_step(run, engines, real.to(run.dtype), z.to(run.dtype))
            synchronize()  # as overhead.py's loop, and as the strategy side's timer
        counter.on = False
    release_raw(engines)
    return counter


COLUMNS = ("strategy", "deepspeed", "lightning", "benchmark", "torch")


def per_step(counter: SyncCounter, steps: int) -> dict[str, float]:
    return {name: counter.origins[name] / steps for name in COLUMNS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["gan", "distill", "single"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["bf16-mixed"])
    parser.add_argument("--arch", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run, which counts 0")
    parser.add_argument("--out", default="outputs/bench/syncs.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    configure(argparse.Namespace(size=args.size, arch=args.arch, device=args.device))
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    device = torch.device(args.device, 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    rows = []
    print("| case | stage | precision | side | strategy | deepspeed | lightning | benchmark | torch |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for precision in args.precisions:
        for case in args.cases:
            for stage in args.stages:
                run = Run(case, stage, args.device, precision)
                data = batches(stage, args.warmup + args.steps, device)
                for side, count in (("A", count_strategy), ("B", count_raw)):
                    counter = count(run, data, args.warmup)
                    counts = per_step(counter, args.steps)
                    rows.append({"case": case, "stage": stage, "precision": precision, "side": side,
                                 "per_step": counts, "strategy_sites": dict(counter.sites)})  # fmt: skip
                    cells = [case, stage, precision, side, *(f"{v:g}" for v in counts.values())]
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)
                    for site, n in counter.sites.most_common(5):
                        print(f"|   strategy site: {site} ({n / args.steps:g} per step) |", flush=True)
                    release_memory()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
