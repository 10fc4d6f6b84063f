"""Real code against DDP: a public package's multi-model training code, fitted under ``DDPStrategy`` and under
``MultiDeepSpeedStrategy`` in the same 2 CPU processes (gloo), every tensor of the final state compared.

The API (stable: cases in other branches are written against it)
----------------------------------------------------------------
A case is a test module ``tests/realcode/test_<package>.py`` that declares::

    CASE = Case(build=make_module, mixed={"teacher": 3, "student": 2}, frozen=("teacher",), find_unused=True)

    @pytest.mark.parametrize("setup", setups(CASE))
    def test_matches_ddp(setup: str, launched: Launched) -> None:
        assert_matches_ddp(launched, setup)

- ``build``: a module-level function returning a new LightningModule that holds the package's modules as the
  package's example holds them, with its own ``configure_optimizers`` and a ``train_dataloader`` built with
  ``tests.distributed.common.sharded_loader`` over data made with torch. The harness seeds torch before each call
  (:data:`SEED`), so two calls build the same weights, and reseeds at ``on_train_start`` (``SEED + rank``), so
  noise drawn in ``training_step`` is the same under every strategy.
- ``launched``: the fixture of ``tests/realcode/conftest.py``: ONE launch per case module (the module's ``CASE``),
  in which each rank fits DDP first, then each setup of this run, one after another.
- :func:`setups` lists the setups this run compares with DDP, as pytest parameters (with the case's ``xfail``
  marks): ``Case.ci`` by default, CI's run (``zero3`` and ``mixed``, where the case has one); ``REALCODE_STAGES=all``
  (``make realcode``) runs ``zero0``, ``zero2``, ``zero3`` and ``mixed``; a comma list (``REALCODE_STAGES=zero2,mixed``)
  names them.
- :func:`assert_matches_ddp` fails where a setup's final state differs from DDP's: a key missing or extra, a shape,
  or any tensor off by more than ``Case.tolerance`` (1e-5, fp32), listing the worst tensors; where the setup's fit
  raised, it fails with that error (a fit that raises on one rank only leaves the other waiting in a collective:
  the launch then fails whole at :data:`TIMEOUT`).

What is compared (:func:`final_state`, read at ``on_train_end`` on every rank, kept from rank 0): every entry of
the LightningModule's ``state_dict`` (weights and buffers, ZeRO-3 partitions gathered:
``strategy.consolidated_state_dict()``), and, for each trained parameter, every optimizer state tensor shaped like
it (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``), keyed ``optimizer/<parameter>/<state>``:
torch's ``optimizer.state`` under DDP and at ZeRO-0, ``deepspeed.utils.safe_get_full_optimizer_state`` at
ZeRO-1/2/3. The step count is left out (ZeRO keeps one per group): it shows in the weights. A moment on one side
only and all zeros (a parameter never stepped: torch keeps no state for it, ZeRO's flat state holds zeros) is skipped.

Setups: ``zeroN`` is ``MultiDeepSpeedStrategy(stage=N)`` with each name in ``Case.frozen`` given an entry at that
stage (a frozen engine, partitioned at ZeRO-3); ``mixed`` gives each submodule of ``Case.mixed`` its own stage
(``engine_configs``), the others ``Case.mixed_default``. At ZeRO-3 every weight is partitioned
(``stage3_param_persistence_threshold: 0``, :data:`PARTITION_ALL`), however small. ``Case.options`` go to every
``MultiDeepSpeedStrategy`` (``ema=``, ``elementwise_optimizers=``); ``Case.find_unused`` to it and to ``DDPStrategy``.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import cpu_trainer
from tests.distributed.harness import on_ranks

SEED = 0
STAGES_VARIABLE = "REALCODE_STAGES"
CI_SETUPS = ("zero3", "mixed")
ALL_SETUPS = ("zero0", "zero2", "zero3", "mixed")
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
"""Every engine's config: at ZeRO-3 every weight is partitioned, as a real model's large ones are (DeepSpeed keeps
weights of up to 1e5 elements whole by default: at the cases' tiny widths, all of them). Unused at ZeRO-0/1/2."""
TIMEOUT = 240.0
"""Seconds one launch (every setup of a case) may take before its ranks are stopped."""


@dataclass(frozen=True)
class Case:
    """What a case module declares as ``CASE`` (see the module's text)."""

    build: Callable[[], pl.LightningModule]
    mixed: Mapping[str, int] | None = None
    """Submodule -> ZeRO stage of the mixed setup; None: the case has no teacher/frozen/EMA part, no mixed setup."""
    mixed_default: int = 2
    """The stage of the submodules ``mixed`` does not name."""
    frozen: tuple[str, ...] = ()
    """Submodules no optimizer trains that become frozen engines (given an entry) at every ``zeroN`` setup."""
    find_unused: bool = False
    """``find_unused_parameters`` of both strategies: some backward leaves a trained parameter without a gradient."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """More ``MultiDeepSpeedStrategy`` arguments, the same at every setup."""
    xfail: Mapping[str, str] = field(default_factory=dict)
    """Setup -> the finding, one line: that setup is expected to fail (strict)."""
    tolerance: float = 1e-5
    extra_state: Callable[[pl.LightningModule], Mapping[str, torch.Tensor]] | None = None
    """Tensors the code keeps outside the module's ``state_dict`` (diffusers' ``EMAModel`` shadow weights), read on
    every rank at the end of training and compared as the others are, keyed as returned."""
    ci: tuple[str, ...] = CI_SETUPS
    """The setups of the default (CI's) run; a case whose ``zero3`` and ``mixed`` are expected to fail adds one that
    trains (``("zero2", "zero3", "mixed")``), so CI still compares it with DDP."""


# ---- pytest side -------------------------------------------------------------------------------------------------


def run_setups(case: Case) -> list[str]:
    """The setups this run compares with DDP: ``REALCODE_STAGES`` (``all``, or a comma list), else CI's."""
    chosen = os.environ.get(STAGES_VARIABLE, "")
    names = ALL_SETUPS if chosen == "all" else tuple(n.strip() for n in chosen.split(",") if n.strip()) or case.ci
    unknown = [name for name in names if name not in ALL_SETUPS]
    if unknown:
        raise ValueError(f"{STAGES_VARIABLE}: unknown setups {unknown}; known: {', '.join(ALL_SETUPS)} or 'all'")
    return [name for name in names if name != "mixed" or case.mixed is not None]


def setups(case: Case) -> list[Any]:
    """:func:`run_setups` as ``pytest.param``s, each expected to fail where ``case.xfail`` names it."""
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=case.xfail[name]))
        if name in case.xfail
        else name
        for name in run_setups(case)
    ]


Launched = dict[str, dict[str, Any]]
"""Rank 0's outcome of each setup, ``"ddp"`` included: ``{"state": {key: tensor}, "seconds": s}`` or
``{"error": text}``."""


def launch(case_module: str, case: Case) -> Launched:
    """One launch on 2 ranks: DDP, then every setup of this run; rank 0's outcomes."""
    return on_ranks(fit_setups, case_module, ["ddp", *run_setups(case)], timeout=TIMEOUT)[0]


def differences(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Key -> the largest absolute difference (``inf`` where a key is missing on one side or the shapes differ)."""
    diffs = {}
    for key in expected.keys() | actual.keys():
        if _never_stepped(key, expected, actual):
            continue
        if key not in expected or key not in actual or expected[key].shape != actual[key].shape:
            diffs[key] = float("inf")
            continue
        gap = (expected[key].double() - actual[key].double()).abs()
        diffs[key] = gap.max().item() if gap.numel() else 0.0
    return diffs


def _never_stepped(key: str, expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> bool:
    """An optimizer state on one side only, all zeros: a parameter never stepped, which torch keeps no state for and
    ZeRO's flat state holds as zeros."""
    if not key.startswith("optimizer/") or (key in expected) == (key in actual):
        return False
    return not (expected[key] if key in expected else actual[key]).any()


def verdict(launched: Launched, setup: str, tolerance: float = 1e-5) -> str:
    """One line: ``MATCH (max abs diff D over K tensors)``, ``DIFFERS ...`` or ``FAILED: error``."""
    for name in ("ddp", setup):
        if "error" in launched[name]:
            return f"FAILED ({name}): {launched[name]['error'].strip().splitlines()[-1]}"
    diffs = differences(launched["ddp"]["state"], launched[setup]["state"])
    worst = max(diffs.values(), default=0.0)
    word = "MATCH" if worst <= tolerance else "DIFFERS"
    return f"{word} (max abs diff {worst:.3g} over {len(diffs)} tensors)"


def assert_matches_ddp(launched: Launched, setup: str, tolerance: float = 1e-5) -> None:
    """Fail unless ``setup``'s final state is DDP's within ``tolerance`` in every tensor."""
    for name in ("ddp", setup):
        if "error" in launched[name]:
            pytest.fail(f"the fit under {name} raised:\n{launched[name]['error']}", pytrace=False)
    diffs = differences(launched["ddp"]["state"], launched[setup]["state"])
    off = sorted(((gap, key) for key, gap in diffs.items() if gap > tolerance), reverse=True)
    lines = [
        f"{key}: {'missing, extra or reshaped' if gap == float('inf') else f'off by {gap:.3g}'}" for gap, key in off
    ]
    assert not off, f"{setup}: {len(off)} of {len(diffs)} tensors differ from DDP's:\n" + "\n".join(lines[:12])


# ---- rank side ---------------------------------------------------------------------------------------------------


def strategy_for(case: Case, setup: str) -> pl.strategies.Strategy:
    """The strategy of ``setup`` (``ddp``, ``zeroN`` or ``mixed``) for ``case``."""
    if setup == "ddp":
        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=case.find_unused)
    if setup == "mixed":
        assert case.mixed is not None
        stages, default = dict(case.mixed), case.mixed_default
    else:
        default = int(setup.removeprefix("zero"))
        stages = dict.fromkeys(case.frozen, default)
    configs = {name: {"zero_optimization": {"stage": stage}} for name, stage in stages.items()}
    options = {"find_unused_parameters": case.find_unused, **case.options}
    return MultiDeepSpeedStrategy(stage=default, config=PARTITION_ALL, engine_configs=configs, **options)


class _Reseed(pl.Callback):
    """Seed torch alike under every strategy once setup is done (each rank its own seed, as a real run draws)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.manual_seed(SEED + 1 + trainer.global_rank)


class _AtEnd(pl.Callback):
    """:func:`final_state` at ``on_train_end``, before teardown stops the engines."""

    def __init__(self, extra_state: Callable[[pl.LightningModule], Mapping[str, torch.Tensor]] | None = None) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.extra_state = extra_state

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = final_state(trainer, pl_module)
        if self.extra_state is not None:
            self.state |= {key: value.detach().cpu().clone() for key, value in self.extra_state(pl_module).items()}


def final_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every state-dict tensor and every per-parameter optimizer state tensor, whole, on the CPU, detached."""
    strategy = trainer.strategy
    if isinstance(strategy, MultiDeepSpeedStrategy):
        weights, moments = strategy.consolidated_state_dict(), engine_moments(strategy, module)
    else:
        weights, moments = module.state_dict(), torch_moments(trainer.optimizers, module)
    state = {key: value.detach().cpu().clone() for key, value in weights.items() if isinstance(value, torch.Tensor)}
    return state | {key: value.detach().cpu().clone() for key, value in moments.items()}


def _names(module: torch.nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}


def torch_moments(optimizers: list[torch.optim.Optimizer], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``optimizer/<parameter>/<state>`` for each state tensor shaped like its parameter, of torch optimizers."""
    names, moments = _names(module), {}
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and key != "step":
                    moments[f"optimizer/{names[id(param)]}/{key}"] = value
    return moments


def engine_moments(strategy: MultiDeepSpeedStrategy, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`torch_moments` of every trained engine: torch's state at ZeRO-0, DeepSpeed's per parameter above."""
    from deepspeed.utils import safe_get_full_optimizer_state

    names, moments = _names(module), {}
    for engine in (optimizer.engine for optimizer in strategy.optimizers):  # trained engines: frozen ones have none
        if engine.zero_optimization_stage() == 0:
            moments |= torch_moments([engine.optimizer], module)
            continue
        keys = _flat_state_keys(engine.optimizer.optimizer)
        for param in engine.module.parameters():
            if param.requires_grad:
                for key in keys:
                    full = safe_get_full_optimizer_state(param, key)
                    if full is not None:
                        moments[f"optimizer/{names[id(param)]}/{key}"] = full
    return moments


def _flat_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The state keys of DeepSpeed's inner optimizer that hold a tensor per element (shaped like its flat tensor)."""
    keys: set[str] = set()
    for flat, state in optimizer.state.items():
        keys |= {key for key, value in state.items() if isinstance(value, torch.Tensor) and value.shape == flat.shape}
    return sorted(keys - {"step"})


def fit_one(case: Case, setup: str) -> dict[str, Any]:
    """Fit a new module of ``case`` under ``setup``'s strategy; its final state and seconds, or the error."""
    torch.manual_seed(SEED)
    module, at_end = case.build(), _AtEnd(case.extra_state)
    trainer = cpu_trainer(
        strategy_for(case, setup),
        callbacks=[_Reseed(), at_end],
        use_distributed_sampler=False,
        enable_checkpointing=False,
    )
    start = time.perf_counter()
    try:
        trainer.fit(module)
    except Exception:  # recorded: the next setups still run, and the test of this one reports it
        return {"error": traceback.format_exc(limit=-6)}
    return {"state": at_end.state, "seconds": time.perf_counter() - start}


def fit_setups(case_module: str, names: list[str]) -> Launched:
    """On each rank: :func:`fit_one` for each setup in ``names``, in order (DDP first)."""
    case = import_module(case_module).CASE
    return {name: fit_one(case, name) for name in names}
