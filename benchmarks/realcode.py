"""Real code against DDPStrategy: engine build and step time of the real-code suite's cases (``tests/realcode``).

One launch per case, on 2 CPU processes from the repository root (``make bench-realcode`` runs every case)::

    torchrun --nproc-per-node 2 benchmarks/realcode.py --case transformers_distillation --rounds 5 --steps 20

Each case is the suite's own module (its ``CASE.build``: a public package's models composed as its docs train
them, at the suite's tiny widths), its data made ``--warmup + --steps`` optimizer steps long (the case module's
``STEPS``). Sides, every one fitted in each round of this launch:

* ``ddp``: Lightning's ``DDPStrategy`` (gloo), as the suite's reference;
* ``zero2``, ``zero3`` (and ``mixed`` with ``--mixed``): ``MultiDeepSpeedStrategy`` as the suite builds it
  (``tests.realcode.harness.strategy_for``: every weight partitioned at ZeRO-3, a frozen part its own engine);
* ``ds-zero2``, ``ds-zero3``, for the cases with a hand-written loop (:data:`RAW`): the same submodules wrapped
  by ``deepspeed.initialize`` one per model, from the configs the strategy gives them
  (``lightning_multids._config``), the optimizers of the case's own ``configure_optimizers``, and the case's
  losses and steps written as a DeepSpeed user writes them: ``engine(x)``, ``engine.backward(loss)``,
  ``engine.step()``; no Lightning (the belief state's accumulation and clipping are DeepSpeed's own there, set in
  its config). Each reaches the strategy's final weights at the same stage (checked when
  written: bit for bit for the distillation and the belief state, within 1.2e-7 for the VQ-GAN, whose
  discriminator scores real and generated images in one forward there). The metric-learning case has none: its
  one loss backpropagates into two trained engines, which ``engine.backward`` of one of them leaves the other's
  reduction unfinished for (the strategy routes it: ``lightning_multids/_routing.py``).
* ``zero2-as-loop``, ``zero3-as-loop``, where the loop does less work than the case's step (the VQ-GAN's): the
  case's module with the loop's step, under the strategy. The strategy's share is taken against these (the same
  work), and what the case's own pattern costs (strategy as written minus as-loop) is named apart.

Measured on rank 0, per fit:

* ``build``: under Lightning, from the callbacks' ``setup`` to ``on_fit_start`` (Lightning's ``post_setup``
  barrier, ``configure_model`` and ``strategy.setup``: DDP's wrapping of the module, the strategy's planning and
  engines); in the hand-written loop, the ``deepspeed.initialize`` calls;
* ``first``: from ``trainer.fit`` (in the loop: from building its engines) to the start of the first
  ``training_step``: what a user waits for before training starts (under Lightning, the Trainer's own set-up and
  the first batch too);
* ``step``: the wall time of each optimizer step after ``--warmup`` of them (``common.StepMeter``: from the batch
  handed to the module to the step's return; the belief-state case's 2 accumulated batches count as one step).

Rounds: one untimed round first (the process group, imports and DeepSpeed's first-use costs), then ``--rounds``
rounds, each fitting every side once, in turn order reversed every other round, so the machine's drift falls on
every side alike. Reported per setup: each side's median build, first-step and step time with their range over
the rounds, the median (min-max) of per-round ratios strategy/DDP, and the strategy's own share (strategy minus
hand-written DeepSpeed) beside DeepSpeed's own cost (hand-written DeepSpeed minus DDP), as medians of per-round
differences. ``--profile PATH`` profiles (cProfile) one ZeRO-3 fit's build window (``--profile-window steps``: its
timed steps) on rank 0 instead, and prints the strategy's own functions by cumulative time.

At these widths (thousands of parameters) a step is a few milliseconds of compute: the figures are Python's and
DeepSpeed's fixed costs per engine and per step, not what a model of real size spends.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

import deepspeed
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import StepMeter, release_memory

from lightning_multids._compat.deepspeed import release_engine
from lightning_multids._config import engine_config, frozen_config, sized_buckets
from tests.distributed.common import cpu_trainer
from tests.realcode.harness import PARTITION_ALL, SEED, Case, strategy_for

Fit = dict[str, Any]
"""One fit's times on rank 0: ``build`` and ``first`` in seconds, ``steps`` (seconds per optimizer step)."""


# ---- the Lightning sides ---------------------------------------------------------------------------------------


class Clock(StepMeter):
    """:class:`common.StepMeter`, plus the build window and the first step's start, and the suite's reseeding.

    With ``profile``, the profiler runs over the build window (``window="build"``) or the timed steps (``"steps"``).
    """

    def __init__(self, warmup: int, profile: cProfile.Profile | None = None, window: str = "build") -> None:
        super().__init__(warmup)
        self.profile, self.window = profile, window
        self.marks: dict[str, float] = {}

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.marks["setup"] = time.perf_counter()
        if self.profile is not None and self.window == "build":
            self.profile.enable()

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.profile is not None and self.window == "build":
            self.profile.disable()
        self.marks["built"] = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.profile is not None and self.window == "steps":
            self.profile.disable()

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        torch.manual_seed(SEED + 1 + trainer.global_rank)  # as the suite's harness: noise alike on every side

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.marks.setdefault("first", time.perf_counter())
        if self.profile is not None and self.window == "steps" and self._batches == self.warmup:
            self.profile.enable()
        super().on_train_batch_start(trainer, module, *args)


def fit_lightning(
    case: Case,
    setup: str,
    warmup: int,
    per_step: int,
    profile: cProfile.Profile | None = None,
    window: str = "build",
) -> Fit:
    """Fit a new module of ``case`` under ``setup``'s strategy (``ddp``, ``zeroN``, ``mixed``), as the suite does."""
    torch.manual_seed(SEED)
    module = case.build()
    clock = Clock(warmup * per_step, profile, window)
    trainer = cpu_trainer(
        strategy_for(case, setup), callbacks=[clock], use_distributed_sampler=False, enable_checkpointing=False
    )
    start = time.perf_counter()
    trainer.fit(module)
    return {
        "build": clock.marks["built"] - clock.marks["setup"],
        "first": clock.marks["first"] - start,
        "steps": per_optimizer_step(clock.times, per_step),
    }


def per_optimizer_step(times: list[float], per_step: int) -> list[float]:
    """Batch times summed ``per_step`` at a time (accumulated batches and the step they end in)."""
    return [sum(times[i : i + per_step]) for i in range(0, len(times) - per_step + 1, per_step)]


# ---- the hand-written DeepSpeed loops --------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A hand-written DeepSpeed loop of a case: which submodules are frozen engines, and one step over the engines."""

    frozen: tuple[str, ...]
    step: Callable[[types.ModuleType, dict[str, Any], Any], None]
    config: Callable[[types.ModuleType], dict[str, Any]] = lambda case: {}
    """Settings of the loop's own (every engine's config, over the strategy's): what DeepSpeed is told to do that
    the case does in its step under Lightning."""
    as_loop: Callable[[types.ModuleType], pl.LightningModule] | None = None
    """Where the loop does less work than the case's step (raw DeepSpeed cannot do it all): the case's module with
    the loop's step, fitted under the strategy too (sides ``zeroN-as-loop``), so that the strategy's share compares
    the same work and the case's own pattern is named apart."""


def distillation_step(case: types.ModuleType, engines: dict[str, Any], input_ids: torch.Tensor) -> None:
    """The case's ``training_step`` (the guide's distillation loss) over a student engine and a frozen teacher."""
    student, teacher = engines["student"], engines["teacher"]
    student_output = student(input_ids=input_ids, labels=input_ids)
    with torch.no_grad():
        teacher_output = teacher(input_ids=input_ids)
    soft_teacher = F.softmax(teacher_output.logits.flatten(0, 1) / case.TEMPERATURE, dim=-1)
    soft_student = F.log_softmax(student_output.logits.flatten(0, 1) / case.TEMPERATURE, dim=-1)
    distillation_loss = F.kl_div(soft_student, soft_teacher, reduction="batchmean") * case.TEMPERATURE**2
    student.backward((1.0 - case.LAMBDA) * student_output.loss + case.LAMBDA * distillation_loss)
    student.step()


def vqgan_step(case: types.ModuleType, engines: dict[str, Any], x: torch.Tensor) -> None:
    """The case's two steps over two trained engines, as raw DeepSpeed allows them.

    One engine forward per engine per backward: the discriminator inside the autoencoder's loss is called as its
    module with its parameters frozen (the case computes their gradients there and its ``zero_grad()`` drops them),
    and its own loss scores real and generated images in one forward (two engine forwards before one backward skip
    DeepSpeed's reduction). The discriminator has no batch statistics, so the losses are the case's.
    """
    autoencoder, discriminator = engines["autoencoder"], engines["discriminator"]
    out, _, commit_loss = autoencoder(x)
    out = out.clamp(-1.0, 1.0)
    discriminator.module.requires_grad_(False)
    loss = (out - x).abs().mean() + case.ALPHA * commit_loss - discriminator.module(out).mean()
    autoencoder.backward(loss)
    autoencoder.step()
    discriminator.module.requires_grad_(True)
    real, fake = discriminator(torch.cat([x, out.detach()])).split(len(x))
    discriminator.backward(F.relu(1 - real).mean() + F.relu(1 + fake).mean())
    discriminator.step()


def belief_state_step(case: types.ModuleType, engines: dict[str, Any], batch: torch.Tensor) -> None:
    """The script's loop as DeepSpeed runs it: DeepSpeed divides the loss by the accumulation steps, clips and steps
    at every ``GRADIENT_ACCUMULATE_EVERY``-th ``step()`` (:func:`belief_state_config`)."""
    model = engines["model"]
    model.backward(model(batch))
    model.step()


def belief_state_config(case: types.ModuleType) -> dict[str, Any]:
    return {
        "gradient_accumulation_steps": case.GRADIENT_ACCUMULATE_EVERY,
        "managed_gradient_accumulation": True,  # DeepSpeed's default: it owns the accumulation here
        "gradient_clipping": 0.5,
    }


def vqgan_as_loop(case: types.ModuleType) -> pl.LightningModule:
    """The case's VQ-GAN with :func:`vqgan_step`'s work: the discriminator frozen in the autoencoder's loss, one
    discriminator forward for its own loss."""

    class AsLoop(case.VQGAN):  # type: ignore[name-defined,misc]
        def training_step(self, x: torch.Tensor, batch_idx: int) -> None:
            opt_ae, opt_d = self.optimizers()
            out, _, commit_loss = self.autoencoder(x)
            out = out.clamp(-1.0, 1.0)
            self.discriminator.requires_grad_(False)
            loss = (out - x).abs().mean() + case.ALPHA * commit_loss - self.discriminator(out).mean()
            opt_ae.zero_grad()
            self.manual_backward(loss)
            opt_ae.step()
            self.discriminator.requires_grad_(True)
            real, fake = self.discriminator(torch.cat([x, out.detach()])).split(len(x))
            opt_d.zero_grad()
            self.manual_backward(F.relu(1 - real).mean() + F.relu(1 + fake).mean())
            opt_d.step()

    return AsLoop()


RAW: dict[str, Raw] = {
    "transformers_distillation": Raw(frozen=("teacher",), step=distillation_step),
    "x_transformers_belief_state": Raw(frozen=(), step=belief_state_step, config=belief_state_config),
    "vector_quantize_pytorch": Raw(frozen=(), step=vqgan_step, as_loop=vqgan_as_loop),
}


def rank_loader(module: pl.LightningModule) -> torch.utils.data.DataLoader:
    """The case's ``train_dataloader`` for this rank, without a Trainer (it reads the world size and rank only)."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    module._trainer = types.SimpleNamespace(world_size=world_size, global_rank=rank)  # type: ignore[assignment]
    try:
        return module.train_dataloader()
    finally:
        module._trainer = None


def raw_engines(
    case: types.ModuleType, module: pl.LightningModule, raw: Raw, stage: int, micro_batch: int
) -> dict[str, Any]:
    """One ``deepspeed.initialize`` per submodule, from the configs the strategy's ``zeroN`` setup gives it."""
    optimizers = module.configure_optimizers()
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    owner = {id(p): name for name, child in module.named_children() for p in child.parameters()}
    trains = {owner[id(o.param_groups[0]["params"][0])]: o for o in optimizers}  # before ZeRO replaces the groups
    engines = {}
    for name, child in module.named_children():
        if not any(True for _ in child.parameters()):  # a loss module: no engine, as under the strategy
            continue
        entry = {"zero_optimization": {"stage": stage}} if name in raw.frozen else {}
        config = engine_config(
            name, stage=stage, default=PARTITION_ALL, override=entry, micro_batch_size=micro_batch, device_type="cpu"
        ) | raw.config(case)
        optimizer = trains.get(name)
        if optimizer is None:
            assert name in raw.frozen, f"{name}: no optimizer and not frozen"
            engines[name], *_ = deepspeed.initialize(model=child, config=frozen_config(name, config, entry))
            engines[name].eval()
        else:
            config = sized_buckets(config, sum(p.numel() for p in child.parameters() if p.requires_grad))
            engines[name], *_ = deepspeed.initialize(model=child, optimizer=optimizer, config=config)
    return engines


def fit_raw(case_module: types.ModuleType, raw: Raw, stage: int, warmup: int, per_step: int) -> Fit:
    """The case's steps in a hand-written DeepSpeed loop over the same submodules and data; no Lightning."""
    torch.manual_seed(SEED)
    module = case_module.CASE.build()
    loader = rank_loader(module)
    start = time.perf_counter()
    engines = raw_engines(case_module, module, raw, stage, loader.batch_size or 1)
    built = time.perf_counter()
    batches = iter(loader)  # its base seed drawn before the reseeding, as in Lightning's loop
    torch.manual_seed(SEED + 1 + torch.distributed.get_rank())
    times: list[float] = []
    first = 0.0
    for index, batch in enumerate(batches):
        began = time.perf_counter()
        first = first or began
        raw.step(case_module, engines, batch)
        if index >= warmup * per_step:
            times.append(time.perf_counter() - began)
    for engine in engines.values():
        release_engine(engine)
    return {"build": built - start, "first": first - start, "steps": per_optimizer_step(times, per_step)}


# ---- the launch ------------------------------------------------------------------------------------------------

BATCHES_PER_STEP = {"x_transformers_belief_state": 2}
"""Batches per optimizer step, where a case accumulates (its ``GRADIENT_ACCUMULATE_EVERY``)."""
CASES = (
    "transformers_distillation",
    "x_transformers_belief_state",
    "vector_quantize_pytorch",
    "pytorch_metric_learning",
)


def sides(case: str, mixed: bool) -> list[str]:
    """The sides of ``case``'s launch: DDP, the strategy at ZeRO-2 and -3 (and mixed), the hand-written loops."""
    names = ["ddp", "zero2", "zero3", *(["mixed"] if mixed else [])]
    if case in RAW:
        names += ["ds-zero2", "ds-zero3"]
        names += ["zero2-as-loop", "zero3-as-loop"] if RAW[case].as_loop is not None else []
    return names


def fit_side(case: str, case_module: types.ModuleType, side: str, warmup: int) -> Fit:
    per_step = BATCHES_PER_STEP.get(case, 1)
    if side.startswith("ds-"):
        return fit_raw(case_module, RAW[case], int(side.removeprefix("ds-zero")), warmup, per_step)
    if side.endswith("-as-loop"):
        as_loop = RAW[case].as_loop
        assert as_loop is not None
        same_work = dataclasses.replace(case_module.CASE, build=lambda: as_loop(case_module))
        return fit_lightning(same_work, side.removesuffix("-as-loop"), warmup, per_step)
    return fit_lightning(case_module.CASE, side, warmup, per_step)


def spread(values: Iterable[float]) -> dict[str, float]:
    """The median and range of ``values``."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(fits: Mapping[str, list[Fit]]) -> dict[str, Any]:
    """Per side: build, first-step and step times; per strategy setup: ratios and shares of per-round figures."""
    summary: dict[str, Any] = {"sides": {}}
    for side, runs in fits.items():
        summary["sides"][side] = {
            "build_s": spread(run["build"] for run in runs),
            "first_s": spread(run["first"] for run in runs),
            "step_ms": spread(1e3 * t for run in runs for t in run["steps"]),
            "round_step_ms": [1e3 * statistics.median(run["steps"]) for run in runs],
        }

    def per_round(a: str, b: str, what: str, op: Callable[[float, float], float]) -> dict[str, float]:
        def value(run: Fit) -> float:
            return statistics.median(run["steps"]) if what == "steps" else run[what]

        return spread(op(value(x), value(y)) for x, y in zip(fits[a], fits[b], strict=True))

    ratio, minus = (lambda x, y: x / y), (lambda x, y: x - y)
    summary["setups"] = {}
    for setup in (s for s in fits if s in ("zero2", "zero3", "mixed")):
        row: dict[str, Any] = {
            "step_over_ddp": per_round(setup, "ddp", "steps", ratio),
            "first_over_ddp": per_round(setup, "ddp", "first", ratio),
            "build_over_ddp": per_round(setup, "ddp", "build", ratio),
        }
        raw, same_work = f"ds-{setup}", f"{setup}-as-loop" if f"{setup}-as-loop" in fits else setup
        if same_work != setup:  # the case's pattern that raw DeepSpeed cannot run, apart from the strategy's share
            row["pattern_step_s"] = per_round(setup, same_work, "steps", minus)
        if raw in fits:
            row |= {
                "strategy_share_build_s": per_round(same_work, raw, "build", minus),
                "strategy_share_step_s": per_round(same_work, raw, "steps", minus),
                "deepspeed_build_s": per_round(raw, "ddp", "build", minus),
                "deepspeed_step_s": per_round(raw, "ddp", "steps", minus),
                "step_over_ds": per_round(setup, raw, "steps", ratio),
                "build_over_ds": per_round(setup, raw, "build", ratio),
            }
        summary["setups"][setup] = row
    return summary


def cell(figure: Mapping[str, float], scale: float = 1e3, digits: int = 0) -> str:
    """``median (min-max)`` of a spread, scaled (seconds to ms by default)."""
    low, high = figure["min"] * scale, figure["max"] * scale
    return f"{figure['median'] * scale:.{digits}f} ({low:.{digits}f} to {high:.{digits}f})"


def medians(sides: list[Mapping[str, Any] | None], key: str, scale: float, digits: int) -> str:
    """``a / b / c``: each side's median of ``key``, scaled; ``-`` for a side not run."""
    return " / ".join("-" if side is None else f"{side[key]['median'] * scale:.{digits}f}" for side in sides)


def report(case: str, summary: dict[str, Any], args: argparse.Namespace) -> None:
    """Print one markdown row per strategy setup on rank 0, and save the summary as JSON.

    Columns: build ms (DDP / DeepSpeed loop / strategy), first step ms (DDP / strategy), step ms (the three), the
    ratios strategy/DDP of the first step and of the step, then the strategy's share and DeepSpeed's own cost of
    the build (ms) and of the step (ms), each a median (range) of per-round differences; where the loop does less
    work than the case (``as_loop``), the share is taken against the case's module with the loop's step, and the
    step time that the case's own pattern adds is shown beside it.
    """
    sides_ = summary["sides"]
    for setup, row in summary["setups"].items():
        compared = [sides_["ddp"], sides_.get(f"ds-{setup}"), sides_[setup]]
        cells = [
            case,
            setup,
            medians(compared, "build_s", 1e3, 0),
            medians([compared[0], compared[2]], "first_s", 1e3, 0),
            medians(compared, "step_ms", 1, 1),
            cell(row["first_over_ddp"], 1, 1),
            cell(row["step_over_ddp"], 1, 2),
        ]
        if "strategy_share_build_s" in row:
            pattern = row.get("pattern_step_s")
            beside = f" (the case's own pattern: {cell(pattern, 1e3, 1)})" if pattern else ""
            cells += [
                f"{cell(row['strategy_share_build_s'])}; {cell(row['strategy_share_step_s'], 1e3, 1)}{beside}",
                f"{cell(row['deepspeed_build_s'])}; {cell(row['deepspeed_step_s'], 1e3, 1)}",
            ]
        else:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |", flush=True)
    out = Path(args.out) / f"{case}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **summary}, indent=2))


def profile_fit(case: str, case_module: types.ModuleType, args: argparse.Namespace) -> None:
    """cProfile one ZeRO-3 fit on rank 0, over its build window (``setup`` to ``on_fit_start``) or its timed steps
    (``--profile-window``; the steps of the case's module with the loop's step where it has one, ``as_loop``); print
    the strategy's own functions by cumulative time and save the profile to ``args.profile``."""
    rank = torch.distributed.get_rank()
    profile = cProfile.Profile() if rank == 0 else None
    per_step, built = BATCHES_PER_STEP.get(case, 1), case_module.CASE
    as_loop = RAW[case].as_loop if case in RAW else None
    if args.profile_window == "steps" and as_loop is not None:
        built = dataclasses.replace(built, build=lambda: as_loop(case_module))
    fit_lightning(built, "zero3", args.warmup, per_step, profile, args.profile_window)
    if profile is None:
        return
    profile.dump_stats(args.profile)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
    stats.print_stats("lightning_multids", 40)
    print(text.getvalue(), flush=True)
    rows = {f"{path}:{name}": row for (path, _, name), row in stats.stats.items()}  # type: ignore[attr-defined]
    if args.profile_window == "steps":
        own = sum(row[2] for key, row in rows.items() if "lightning_multids" in key)
        agreeing = sum(
            row[3]
            for key, row in rows.items()
            if key.endswith(("_routing.py:agree", "_routing.py:refuse_uneven_zero3"))
        )
        steps = args.steps
        print(
            f"{steps} steps, per step: {1e3 * stats.total_tt / steps:.1f} ms profiled; the own time of the strategy's "  # type: ignore[attr-defined]
            f"functions {1e3 * own / steps:.1f} ms; the reach agreement's all-reduces (find_unused_parameters), "
            f"waits for the other rank included, {1e3 * agreeing / steps:.1f} ms",
            flush=True,
        )
        return
    cumulative = {key: row[3] for key, row in rows.items()}
    window = stats.total_tt  # type: ignore[attr-defined]
    setup = max(seconds for key, seconds in cumulative.items() if key.endswith("lightning_multids/strategy.py:setup"))
    initialize = sum(seconds for key, seconds in cumulative.items() if key.endswith("deepspeed/__init__.py:initialize"))
    print(
        f"build window {1e3 * window:.0f} ms: strategy.setup {1e3 * setup:.0f} ms (deepspeed.initialize "
        f"{1e3 * initialize:.0f} ms, the strategy's own {1e3 * (setup - initialize):.0f} ms), Lightning's barrier "
        f"and hooks {1e3 * (window - setup):.0f} ms",
        flush=True,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each fitting every side once")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps per fit before the timed ones")
    parser.add_argument("--mixed", action="store_true", help="also the case's mixed setup, where it has one")
    parser.add_argument("--profile", help="cProfile one ZeRO-3 fit on rank 0 into this file, then stop")
    parser.add_argument("--profile-window", choices=["build", "steps"], default="build", help="what --profile covers")
    parser.add_argument("--out", default="outputs/bench/realcode")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    warnings.filterwarnings("ignore")
    case_module = import_module(f"tests.realcode.test_{args.case}")
    case_module.STEPS = args.warmup + args.steps  # the case's data: this many optimizer steps per rank
    names = sides(args.case, args.mixed and case_module.CASE.mixed is not None)
    for side in names:  # untimed: the process group, imports and first-use costs
        fit_side(args.case, case_module, side, args.warmup)
        release_memory()
    if args.profile:
        profile_fit(args.case, case_module, args)
        return
    fits: dict[str, list[Fit]] = {side: [] for side in names}
    for round_ in range(args.rounds):
        for side in names if round_ % 2 == 0 else names[::-1]:
            fits[side].append(fit_side(args.case, case_module, side, args.warmup))
            release_memory()
    if torch.distributed.get_rank() == 0:
        report(args.case, summarize(fits) | {"fits": fits}, args)


if __name__ == "__main__":
    main()
