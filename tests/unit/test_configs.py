"""Every YAML in configs/ parses with the real CLI parser (nothing runs), and its strategy can be built."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.cli import MultiDeepSpeedCLI
from lightning_multids.utilities import RunSummary

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


class ParseOnly(MultiDeepSpeedCLI):
    """The CLI up to a parsed, type-checked config: no Trainer, module or data module is built."""

    def instantiate_classes(self) -> None:
        pass


def parse(path: Path) -> ParseOnly:
    with mock.patch.dict(os.environ):  # the CLI's `seed_everything` sets PL_GLOBAL_SEED and others: leave none behind
        return ParseOnly(args=["--config", str(path)], run=False)


def test_every_example_has_a_config() -> None:
    names = {path.stem for path in CONFIGS}
    examples = {"gan", "distill_teacher", "distill_student", "distill", "rlhf", "contrastive"}
    assert examples | {"lm_distill_teacher", "lm_distill", "dpo"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_starts_with_its_command(path: Path) -> None:
    assert path.read_text().splitlines()[0] == f"# lightning-multids fit --config configs/{path.name}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_its_strategy_builds(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # engine JSON paths and class paths are relative to the repository root
    monkeypatch.syspath_prepend(str(REPO))
    config = parse(path).config
    strategy = config.trainer.strategy
    if isinstance(strategy, str):
        assert strategy == MultiDeepSpeedStrategy.strategy_name
        return
    assert strategy.class_path == "lightning_multids.MultiDeepSpeedStrategy"
    built = MultiDeepSpeedStrategy(**dict(strategy.init_args))
    for name, source in (strategy.init_args.get("engine_configs") or {}).items():
        if isinstance(source, str):
            assert built.engine_configs[name] == json.loads((REPO / source).read_text())


def test_a_wrong_strategy_argument_is_refused_at_parse_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "gan.yaml").read_text().replace("stage: 2", "stages: 2"))
    with pytest.raises(SystemExit):
        parse(bad)


def _checkpoint_callbacks(path: Path, dirpath: Path) -> list[ModelCheckpoint]:
    callbacks = yaml.safe_load(path.read_text())["trainer"].get("callbacks") or []
    return [
        ModelCheckpoint(**{**(entry.get("init_args") or {}), "dirpath": dirpath})
        for entry in callbacks
        if entry["class_path"] == "lightning.pytorch.callbacks.ModelCheckpoint"
    ]


class Worsening(BoringModel):
    """Logs ``metric`` worse each epoch (for ``mode``): the first epoch stays the best."""

    def __init__(self, metric: str, mode: str) -> None:
        super().__init__()
        self.metric, self.sign = metric, 1.0 if mode == "min" else -1.0

    def validation_step(self, batch: object, batch_idx: int) -> None:
        self.log(self.metric, self.sign * float(self.current_epoch))


RESUMED = [p for p in CONFIGS if any(c.save_last or c.filename == "last" for c in _checkpoint_callbacks(p, p))]


@pytest.mark.parametrize("path", RESUMED, ids=lambda p: p.name)
def test_last_checkpoint_holds_the_last_epoch_not_the_best(path: Path, tmp_path: Path) -> None:
    """What ``--ckpt_path last`` resumes from: Lightning 2.6 writes ``save_last`` only when it saves a checkpoint."""
    callbacks = _checkpoint_callbacks(path, tmp_path)
    watched = next((c for c in callbacks if c.monitor), None)
    module = Worsening(watched.monitor, watched.mode) if watched else BoringModel()
    trainer = pl.Trainer(
        max_epochs=3, limit_train_batches=1, limit_val_batches=1, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module)
    last = tmp_path / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
    assert torch.load(last, weights_only=True)["epoch"] == 2
    if watched:  # the run's summary names it beside the best
        lines = RunSummary().lines(trainer, module)
        assert any(line.startswith("Last checkpoint:") and line.endswith(last.name) for line in lines), lines
