"""Host time per step: what the strategy adds to a raw DeepSpeed loop when compute is near zero, per function.

No GPU needed: the cases of ``benchmarks/overhead.py`` at ``--size tiny`` (widths of 8, two examples per step,
the depth of the GPU models), where a step is almost all Python. One process (``make bench-host`` runs every
case)::

    torchrun --nproc-per-node 1 benchmarks/host.py --case gan --arch transformer --stage 2

First ``--rounds`` rounds alternate A (the strategy) and B (the raw loop), uninstrumented, as in
``overhead.py``: the strategy's extra milliseconds per step are the median of A minus the median of B (and the
range of that difference over the rounds). Then one more run of each side has a timer around each of the
strategy's functions on the step's path and around what they call out to: the step's own code (the
LightningModule's ``training_step``, B's loop body), the models' ``forward``, autograd's ``backward``,
DeepSpeed's ``forward``, ``backward``, prologue, epilogue, ``step`` and ``zero_grad``, and Lightning's wrappers
(``manual_backward``, ``toggle_optimizer``, the optimizer step and its closure, and what Lightning's own
``Strategy.backward`` runs around the backward under any strategy: the strategy's and the precision plugin's
``pre_backward``/``post_backward`` with the ``on_before_backward``/``on_after_backward`` hooks, and
``LightningModule.backward``). Each row is a function's own
(exclusive) time per step: its time minus that of the timed calls inside it; A's column beside B's. "The loop"
is Lightning's wrappers plus the step time spent outside every timed function (for B: its input cast and timer).
The timers add about a microsecond per call; the instrumented step time is shown beside the uninstrumented one.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import overhead
import torch
from common import StepMeter, release_memory
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from overhead import MODULES, Run, batches, configure, run_raw, run_strategy
from torch import nn

from lightning_multids import _engines as engines
from lightning_multids import _lifecycle as lifecycle
from lightning_multids import _nonfinite as nonfinite
from lightning_multids import _routing as routing
from lightning_multids._optimizer import EngineOptimizer
from lightning_multids.strategy import MultiDeepSpeedStrategy

STRATEGY = "strategy"
GRADIENT_HOOK = "gradient hook (per parameter; find_unused_parameters, reentrant checkpoints, fp16 factors)"
OUTPUT_HOOK = "output check (forward hook per engine call; its tensor hook in the backward is not timed)"
LIGHTNING = "the loop (A: Lightning's)"
OUTSIDE = {
    "user": "the user's training_step",
    "autograd": "autograd",
    "forward": "the models' forward",
    "deepspeed": "DeepSpeed (B runs it too)",
}


class HostProfile:
    """Own time and calls per label, for functions wrapped with :meth:`timed`; nested calls are subtracted."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.kind: dict[str, str] = {}
        self.outermost = 0.0
        self._children: list[float] = []

    def reset(self) -> None:
        self.own.clear()
        self.calls.clear()
        self.outermost = 0.0

    def timed(self, label: str, kind: str, function: Callable) -> Callable:
        self.kind[label] = kind

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.own[label] += elapsed - self._children.pop()
                self.calls[label] += 1
                if self._children:
                    self._children[-1] += elapsed
                else:
                    self.outermost += elapsed

        return wrapper


def targets(case: str) -> list[tuple[Any, str, str, str]]:
    """(owner, attribute, label, kind) of every function timed: the strategy's, and what it calls out to."""
    return [
        (engines, "reached_engines", "discovery: graph walk (fp16 at different scales only)", STRATEGY),
        (routing.Router, "_start", "reach query (start of each backward)", STRATEGY),
        (routing.Route, "enter", "backward prologue call", STRATEGY),
        (routing.Route, "finish", "backward epilogue calls", STRATEGY),
        (routing.Route, "leave", "backward exit marks", STRATEGY),
        (MultiDeepSpeedStrategy, "backward", "backward routing (strategy.backward, EngineSet.backward)", STRATEGY),
        (EngineOptimizer, "zero_grad", "clearing (zero_grad)", STRATEGY),
        (nonfinite, "_refuse_nonfinite", "non-finite check (stage 0 fp32 only)", STRATEGY),
        (EngineOptimizer, "step", "optimizer step wrapper", STRATEGY),
        (MultiDeepSpeedStrategy, "training_step", "training_step hook", STRATEGY),
        (MultiDeepSpeedStrategy, "optimizer_step", "optimizer_step hook", STRATEGY),
        (MODULES[case], "training_step", OUTSIDE["user"], "user"),
        (torch.autograd, "backward", OUTSIDE["autograd"], "autograd"),
        (nn.Sequential, "forward", OUTSIDE["forward"], "forward"),  # every model of overhead.py, both sides
        (overhead.Encoder, "forward", OUTSIDE["forward"], "forward"),
        (DeepSpeedEngine, "forward", OUTSIDE["deepspeed"], "deepspeed"),  # B only
        (DeepSpeedEngine, "backward", OUTSIDE["deepspeed"], "deepspeed"),  # B only
        (DeepSpeedEngine, "_backward_prologue", OUTSIDE["deepspeed"], "deepspeed"),
        (DeepSpeedEngine, "_backward_epilogue", OUTSIDE["deepspeed"], "deepspeed"),
        (DeepSpeedEngine, "step", OUTSIDE["deepspeed"], "deepspeed"),
        (DeepSpeedEngine, "zero_grad", OUTSIDE["deepspeed"], "deepspeed"),
        (ZeROOptimizer, "clear_backward_seen_flag", OUTSIDE["deepspeed"], "deepspeed"),
        (DeepSpeedZeroOptimizer, "clear_backward_seen_flag", OUTSIDE["deepspeed"], "deepspeed"),
        (DeepSpeedZeroOptimizer_Stage3, "clear_backward_seen_flag", OUTSIDE["deepspeed"], "deepspeed"),
        (pl.LightningModule, "manual_backward", LIGHTNING, "lightning"),
        (pl.LightningModule, "toggle_optimizer", LIGHTNING, "lightning"),
        (pl.LightningModule, "untoggle_optimizer", LIGHTNING, "lightning"),
        (LightningOptimizer, "step", LIGHTNING, "lightning"),
        (Strategy, "backward", LIGHTNING, "lightning"),
        (Strategy, "pre_backward", LIGHTNING, "lightning"),  # what Lightning's backward calls around ours too
        (Strategy, "post_backward", LIGHTNING, "lightning"),
        (DDPStrategy, "pre_backward", LIGHTNING, "lightning"),
        (DDPStrategy, "post_backward", LIGHTNING, "lightning"),
        (Precision, "pre_backward", LIGHTNING, "lightning"),  # the on_before_backward hooks
        (Precision, "backward", LIGHTNING, "lightning"),
        (Precision, "post_backward", LIGHTNING, "lightning"),  # the on_after_backward hooks
        (pl.LightningModule, "backward", LIGHTNING, "lightning"),
        (Precision, "optimizer_step", LIGHTNING, "lightning"),
        (Precision, "_wrap_closure", LIGHTNING, "lightning"),  # the closure and on_before_optimizer_step hooks
    ]


@contextmanager
def instrumented(profile: HostProfile, case: str) -> Iterator[None]:
    """Wrap every target with a timer for the body; the input-cast hooks too (built at setup by ``lifecycle``)."""
    originals = []
    for owner, name, label, kind in targets(case):
        originals.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, profile.timed(label, kind, getattr(owner, name)))
    cast_inputs, gradient_hook = lifecycle.cast_inputs, routing.Router._gradient_hook
    output_hook = routing.Router._output_hook
    lifecycle.cast_inputs = lambda dtype: profile.timed("input cast (forward pre-hook)", STRATEGY, cast_inputs(dtype))  # type: ignore[assignment]
    routing.Router._gradient_hook = lambda *args: profile.timed(GRADIENT_HOOK, STRATEGY, gradient_hook(*args))  # type: ignore[method-assign]
    routing.Router._output_hook = lambda *args: profile.timed(OUTPUT_HOOK, STRATEGY, output_hook(*args))  # type: ignore[method-assign]
    try:
        yield
    finally:
        lifecycle.cast_inputs, routing.Router._gradient_hook = cast_inputs, gradient_hook  # type: ignore[method-assign]
        routing.Router._output_hook = output_hook  # type: ignore[method-assign]
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


class ProfiledSteps(StepMeter):
    """Step times after warm-up, with the profile reset when timing starts."""

    def __init__(self, warmup: int, profile: HostProfile) -> None:
        super().__init__(warmup)
        self.profile = profile

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self._batches == self.warmup:
            self.profile.reset()
        super().on_train_batch_start(trainer, module, *args)


def profiled_run(run: Run, data: list, warmup: int) -> tuple[HostProfile, list[float]]:
    """One instrumented fit of A: the profile of its timed steps, and their times."""
    profile = HostProfile()
    meter = ProfiledSteps(warmup, profile)
    with instrumented(profile, run.case):
        run_strategy(run, data, warmup, meter)
    return profile, meter.times


def profiled_raw(run: Run, data: list, warmup: int) -> tuple[HostProfile, list[float]]:
    """One instrumented run of B: the same timers (the loop's step counts as the user's code), after warm-up."""
    profile = HostProfile()
    raw_step, calls = overhead.raw_step, 0

    def counted(*args: Any) -> None:
        nonlocal calls
        if calls == warmup:
            profile.reset()
        calls += 1
        raw_step(*args)

    overhead.raw_step = profile.timed(OUTSIDE["user"], "user", counted)
    try:
        with instrumented(profile, run.case):
            times = run_raw(run, data, warmup)
    finally:
        overhead.raw_step = raw_step
    return profile, times


def split(profile: HostProfile, step_times: list[float]) -> dict[str, float]:
    """Milliseconds per step: each strategy function's own time, the outside work, and the loop's own time.

    The loop's own time is that of Lightning's wrappers plus what the step spends outside every timed function
    (for B, the hand-written loop's: the input cast and the timer).
    """
    steps = len(step_times)
    rows: dict[str, float] = {label: 0.0 for label, kind in profile.kind.items() if kind == STRATEGY}
    rows = defaultdict(float, rows)  # a function never called shows 0 (the graph walk, outside fp16)
    for label, seconds in profile.own.items():
        kind = profile.kind[label]
        if kind == STRATEGY:
            rows[label] += 1e3 * seconds / steps
        elif kind == "lightning":
            rows[LIGHTNING] += 1e3 * seconds / steps
        else:
            rows[OUTSIDE[kind]] += 1e3 * seconds / steps
    rows[LIGHTNING] += 1e3 * (sum(step_times) - profile.outermost) / steps
    rows["instrumented step"] = 1e3 * statistics.mean(step_times)
    return dict(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(MODULES), required=True)
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    parser.add_argument("--arch", choices=["mlp", "transformer"], default="transformer")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="outputs/bench/host")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    configure(argparse.Namespace(size="tiny", device="cpu", arch=args.arch))
    run = Run(args.case, args.stage, "cpu", args.precision)
    a_runs, b_runs = [], []
    for round_ in range(args.rounds):
        data = batches(1000 * round_, args.warmup + args.steps, torch.device("cpu"))
        for side in [run_strategy, run_raw] if round_ % 2 == 0 else [run_raw, run_strategy]:
            (a_runs if side is run_strategy else b_runs).append(side(run, data, args.warmup))
            release_memory()
    profile, times = profiled_run(run, batches(7, args.warmup + args.steps, torch.device("cpu")), args.warmup)
    raw_profile, raw_times = profiled_raw(run, batches(7, args.warmup + args.steps, torch.device("cpu")), args.warmup)
    a_ms = 1e3 * statistics.median(t for r in a_runs for t in r)
    b_ms = 1e3 * statistics.median(t for r in b_runs for t in r)
    rows, raw_rows = split(profile, times), split(raw_profile, raw_times)
    strategy_ms = sum(ms for label, ms in rows.items() if profile.kind.get(label) == STRATEGY)
    extra = sorted(1e3 * (statistics.median(a) - statistics.median(b)) for a, b in zip(a_runs, b_runs, strict=True))
    summary = {"a_ms": a_ms, "b_ms": b_ms, "extra_ms": a_ms - b_ms, "extra_min_ms": extra[0], "extra_max_ms": extra[-1]}
    summary["strategy_own_ms"] = strategy_ms
    report(args, summary, rows, raw_rows)


def report(args: argparse.Namespace, summary: dict[str, float], rows: dict[str, float], raw: dict[str, float]) -> None:
    """Print the summary row and the per-function split of A beside B's; save both as JSON."""
    print(
        f"| {args.case} | {args.arch} | {args.stage} | {args.precision} | {summary['a_ms']:.2f} | "
        f"{summary['b_ms']:.2f} | {summary['extra_ms']:+.2f} ({summary['extra_min_ms']:+.2f} to "
        f"{summary['extra_max_ms']:+.2f}) | {summary['strategy_own_ms']:.2f} | "
        f"{rows[LIGHTNING]:.2f} |",
        flush=True,
    )
    for label, ms in sorted(rows.items(), key=lambda item: -item[1]):
        print(f"|   {label} | {ms:.3f} | {raw[label]:.3f} |" if label in raw else f"|   {label} | {ms:.3f} | |")
    out = Path(args.out) / f"{args.case}_{args.arch}_zero{args.stage}_{args.precision}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **summary, "split_ms": rows, "raw_split_ms": raw}, indent=2))


if __name__ == "__main__":
    main()
