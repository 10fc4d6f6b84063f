"""Per-rank script: fit fuzz cases under MultiDeepSpeedStrategy, one after the other, and save what they give.

Usage: run_case.py CASES_JSON OUT

CASES_JSON holds a JSON list of cases (``grammar.to_dict``). For case ``i`` each rank writes
``OUT/i.rank<r>.pt`` ({"weights", "reads", "seconds"}) when the fit ends, or ``OUT/i.rank<r>.error.json``
(the exception's type, message and innermost frames) and exits non-zero at the first case that raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from tests.distributed.common import cpu_trainer, finish, sharded_loader
from tests.fuzz import grammar, program
from tests.fuzz.grammar import EDIT_FACTOR, GLOBAL_BATCH, WORLD_SIZE, Case, Engine, Phase

warnings.filterwarnings("ignore")


class StrategyBackend:
    """:class:`program.Backend` through the strategy: this rank's batch, ``manual_backward``, ``opt.step()``."""

    def __init__(self, module: FuzzModule, batch: torch.Tensor) -> None:
        self.module, self.batch = module, batch
        optimizers = module.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.optimizers = dict(zip(module.case.trained, optimizers, strict=True))

    def backward(self, loss_of: program.LossOf, plain: bool) -> None:
        loss = loss_of(self.batch)
        if plain:
            loss.backward()
        else:
            self.module.manual_backward(loss)

    def before_steps(self, phase: Phase) -> None:
        pass

    def step(self, name: str) -> None:
        self.optimizers[name].step()

    def zero_grad(self, name: str) -> None:
        case = self.module.case
        if case.zero_grad_by == "module":
            for part in case.parts(name):
                getattr(self.module, part).zero_grad(set_to_none=case.set_to_none)
        else:
            self.optimizers[name].zero_grad(set_to_none=case.set_to_none)

    def toggled(self, name: str) -> contextlib.AbstractContextManager:
        return self.module.toggled_optimizer(self.optimizers[name])

    def no_sync(self, names: list[str]) -> contextlib.AbstractContextManager:
        return self.module.trainer.strategy.no_sync(*names)  # type: ignore[attr-defined]

    def clip(self, name: str, max_norm: float) -> None:
        self.module.clip_gradients(self.optimizers[name], gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def edit(self, name: str, how: str) -> None:
        if how == "plain":
            for p in getattr(self.module, name).parameters():
                p.data.mul_(EDIT_FACTOR)
            return
        if how == "inplace":
            with torch.no_grad():
                for p in getattr(self.module, name).parameters():
                    p.mul_(EDIT_FACTOR)
            return
        factor = EDIT_FACTOR if self.module.global_rank == 0 else 0.5  # rank 0's edit is every rank's
        with self.module.trainer.strategy.gathered(name, modifier_rank=0) as module:  # type: ignore[attr-defined]
            for p in module.parameters():
                p.mul_(factor)

    def drop_gradient(self, name: str) -> None:
        next(getattr(self.module, name).parameters()).grad = None

    def reset_state(self, name: str) -> None:
        state = self.optimizers[name].state[next(getattr(self.module, name).parameters())]
        if "exp_avg" in state:
            state["exp_avg"].zero_()


class FuzzModule(pl.LightningModule):
    """A case's module; ``per_epoch``: each epoch is one batch, the training step's index is the epoch's."""

    def __init__(self, case: Case, per_epoch: bool = False) -> None:
        super().__init__()
        self.case, self.per_epoch = case, per_epoch
        self.automatic_optimization = False
        for name, module in program.make_modules(case).items():
            setattr(self, name, module)
        self.reads: list[dict[str, Any]] = []

    def submodules(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in self.case.module_names}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        index = self.current_epoch if self.per_epoch else batch_idx
        program.training_step(StrategyBackend(self, batch), self.case, self.submodules(), index)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        modules, case = self.submodules(), self.case
        return [
            program.make_optimizer(str(case.engine(name).optimizer), program.optimizer_params(case, modules, name))
            for name in case.trained
        ]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = program.make_data(self.case)
        if self.per_epoch:  # reloaded at every epoch
            data = program.global_batch(data, self.current_epoch)
        return sharded_loader(self, data, batch_size=GLOBAL_BATCH // WORLD_SIZE)

    def read(self, hook: str, name: str) -> None:
        grads = self.trainer.strategy.full_gradients(name)  # type: ignore[attr-defined]
        self.reads.append({"hook": hook, "engine": name, "grads": {k: v.clone() for k, v in grads.items()}})

    def on_after_backward(self) -> None:
        for name in self.case.read_after_backward:
            self.read("after_backward", name)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.case.read_before_step:
            self.read("before_step", self.case.trained[self.trainer.optimizers.index(optimizer)])


def engine_config(engine: Engine) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": engine.stage}
    config: dict[str, Any] = {"zero_optimization": zero}
    if engine.offload:  # torch's optimizer on the CPU, as tests/distributed/test_patterns.py's OFFLOAD
        zero["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if engine.fp32_grad_accum:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def make_strategy(case: Case, resumed: bool = False) -> MultiDeepSpeedStrategy:
    """The case's strategy; ``resumed``: as its ``Resume`` changes it for the fit after the save."""
    change = case.resume if resumed else None
    configs: dict[str, dict[str, Any] | str] = {}
    for engine in case.engines:
        if engine.joins is not None and not case.part_entries:  # its engine is the first part's: one entry
            continue
        if change is None or engine.name not in change.drop_frozen:
            stage = change.stages.get(engine.name, engine.stage) if change is not None else engine.stage
            configs[engine.name] = engine_config(dataclasses.replace(engine, stage=stage))
    ema = None
    if case.ema is not None and not (change is not None and change.drop_ema):
        configs[case.ema.average] = {"zero_optimization": {"stage": case.ema.stage}}
        ema = {case.ema.average: (case.ema.source, case.ema.decay)}
    return MultiDeepSpeedStrategy(engine_configs=configs, ema=ema, find_unused_parameters=case.find_unused)


class SavesInside(pl.Callback):
    """``trainer.save_checkpoint(path)`` inside ``strategy.gathered(name)`` when training ends."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with trainer.strategy.gathered(self.name):  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)


def fit(case: Case, folder: Path) -> dict[str, Any]:
    """Fit ``case``; with a ``Resume``, up to the save, then again from it (``folder`` holds the checkpoint)."""
    start = time.perf_counter()
    if case.resume is None:
        module = FuzzModule(case)
        strategy = make_strategy(case)
        options = dict(precision=case.precision, use_distributed_sampler=False, enable_checkpointing=False)
        cpu_trainer(strategy, **options).fit(module)
        reads = module.reads
    else:
        strategy, reads = fit_and_resume(case, folder / "saved.ckpt")
    state = strategy.consolidated_state_dict()  # every rank: gathers ZeRO-3 partitions
    weights = {k: v.detach().float().clone() for k, v in state.items()}
    return {"weights": weights, "reads": reads, "seconds": time.perf_counter() - start}


def fit_and_resume(case: Case, path: Path) -> tuple[MultiDeepSpeedStrategy, list[dict[str, Any]]]:
    assert case.resume is not None
    options = dict(
        precision=case.precision,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        reload_dataloaders_every_n_epochs=1,
    )
    inside = [SavesInside(path, case.resume.inside)] if case.resume.inside else []
    first = FuzzModule(case, per_epoch=True)
    trainer = cpu_trainer(make_strategy(case), max_epochs=case.resume.at, callbacks=inside, **options)
    trainer.fit(first)
    if not inside:
        trainer.save_checkpoint(path)
    second, strategy = FuzzModule(case, per_epoch=True), make_strategy(case, resumed=True)
    cpu_trainer(strategy, max_epochs=case.steps, **options).fit(second, ckpt_path=path)
    return strategy, first.reads + second.reads


def describe(error: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(error.__traceback__)
    return {
        "type": type(error).__name__,
        "message": str(error),
        "frames": [f"{frame.filename}:{frame.lineno}:{frame.name}" for frame in frames[-12:]],
    }


def main() -> None:
    cases_json, out = sys.argv[1:]
    cases = [grammar.from_dict(data) for data in json.loads(Path(cases_json).read_text())]
    root = Path(out)
    rank = int(os.environ.get("NODE_RANK", "0")) + int(os.environ.get("LOCAL_RANK", "0"))  # 1 node, or 1 per node
    for index, case in enumerate(cases):
        try:
            result = fit(case, root / str(index))
        except BaseException as error:
            (root / f"{index}.rank{rank}.error.json").write_text(json.dumps(describe(error)))
            raise
        torch.save(result, root / f"{index}.rank{rank}.pt")


if __name__ == "__main__":
    main()
    finish()
