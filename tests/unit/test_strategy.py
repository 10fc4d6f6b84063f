import lightning.pytorch as pl
import pytest

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.precision import EnginePrecision


def test_selectable_by_name() -> None:
    trainer = pl.Trainer(strategy="multi_deepspeed", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, MultiDeepSpeedStrategy)
    assert trainer.strategy.stage == 2


def test_cpu_uses_gloo_and_keeps_lightning_arguments() -> None:
    strategy = MultiDeepSpeedStrategy(stage=3, config={"zero_optimization": {"overlap_comm": False}})
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=1, logger=False)
    assert trainer.strategy is strategy
    assert strategy.num_processes == 2
    assert strategy._get_process_group_backend() == "gloo"


def test_trainer_precision_reaches_the_strategy_without_autocast() -> None:
    trainer = pl.Trainer(
        strategy=MultiDeepSpeedStrategy(), accelerator="cpu", devices=1, precision="bf16-mixed", logger=False
    )
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, EnginePrecision)
    assert plugin.precision == "bf16-mixed"


def test_explicit_process_group_backend_is_kept() -> None:
    strategy = MultiDeepSpeedStrategy(process_group_backend="gloo")
    assert strategy._get_process_group_backend() == "gloo"


def test_engines_are_empty_before_setup() -> None:
    assert MultiDeepSpeedStrategy().engines == {}


def test_value_clipping_is_refused() -> None:
    strategy = MultiDeepSpeedStrategy()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        logger=False,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
    )
    with pytest.raises(ValueError, match=r"gradient_clip_algorithm='value'.*clips by global norm.*'norm'"):
        strategy._default_config(trainer)


def test_trainer_gradient_clip_val_becomes_the_engines_default() -> None:
    strategy = MultiDeepSpeedStrategy(config={"zero_optimization": {"stage": 1}})
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, gradient_clip_val=0.7)
    assert strategy._default_config(trainer)["gradient_clipping"] == 0.7
