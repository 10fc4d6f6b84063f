"""The checks of ``MultiDeepSpeedStrategy(ema=...)`` that need no engine: each error names the entry and the fix."""

from __future__ import annotations

import copy

import pytest
from torch import nn

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._ema import Average, average_entries, check_average_names, check_averages, parse_averages


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.generator_ema = copy.deepcopy(self.generator)
        self.other = nn.Linear(4, 2)


def test_parse_accepts_a_tuple_or_a_yaml_list() -> None:
    parsed = parse_averages({"a": ("g", 0.999), "b": ["g", "0.5"]})
    assert parsed == {"a": Average("a", "g", 0.999), "b": Average("b", "g", 0.5)}
    assert parse_averages(None) == {}


@pytest.mark.parametrize(
    ("ema", "message"),
    [
        ({"a": "g"}, r"entry 'a' is 'g'; give it as \(source submodule, decay\)"),
        ({"a": ("g", 0.9, 1)}, r"give it as \(source submodule, decay\)"),
        ({"a": ("g", "slow")}, r"entry 'a' has the decay 'slow', not a number"),
        ({"a": ("g", 1.0)}, r"decay 1.0; it must be in \[0, 1\)"),
        ({"a": ("g", -0.1)}, r"decay -0.1; it must be in \[0, 1\)"),
        ({"a": ("a", 0.9)}, r"averages 'a' into itself"),
        ({"a": ("g", 0.9), "b": ("a", 0.9)}, r"\['b'\] average another average"),
    ],
)
def test_parse_refuses(ema: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_averages(ema)
    with pytest.raises(ValueError, match=message):  # at construction, before any fit
        MultiDeepSpeedStrategy(ema=ema)


def test_an_average_runs_in_fp32_whatever_the_default() -> None:
    averages = parse_averages({"generator_ema": ("generator", 0.9)})
    entries = average_entries(averages, {"generator": {"bf16": {"enabled": True}}})
    assert entries["generator"] == {"bf16": {"enabled": True}}, "other entries are left alone"
    assert entries["generator_ema"]["bf16"] == {"enabled": False}
    assert entries["generator_ema"]["fp16"] == {"enabled": False}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"optimizer": {"type": "SGD"}}, r"EMA engine 'generator_ema' .* `optimizer` section.*remove the section"),
        ({"bf16": {"enabled": True}}, r"EMA engine 'generator_ema' enables bf16. An average keeps fp32 weights"),
        ({"fp16": {"enabled": True}}, r"enables fp16.*remove the `fp16` section"),
    ],
)
def test_entries_refuse(entry: dict, message: str) -> None:
    averages = parse_averages({"generator_ema": ("generator", 0.9)})
    with pytest.raises(ValueError, match=message):
        average_entries(averages, {"generator_ema": entry})


CONFIGS = {name: {"zero_optimization": {"stage": 2}} for name in ("generator", "generator_ema", "other")}


@pytest.mark.parametrize(
    ("ema", "trainable", "configs", "message"),
    [
        ({"generator_ema": ("generator", 0.9)}, ["generator", "generator_ema"], CONFIGS, r"has an optimizer"),
        ({"generator_ema": ("generator", 0.9)}, ["other"], CONFIGS, r"averages 'generator', which is not a trainable"),
        ({"other": ("generator", 0.9)}, ["generator"], CONFIGS, r"cannot average 'generator': their parameters diff"),
        (
            {"generator_ema": ("generator", 0.9)},
            ["generator"],
            {**CONFIGS, "generator_ema": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}},
            r"\['generator_ema'\] offload parameters to NVMe.*`device: cpu`",
        ),
    ],
)
def test_setup_refuses(ema: dict, trainable: list[str], configs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_averages(parse_averages(ema), Module(), trainable, configs)


def test_setup_accepts_a_copy_of_a_trained_submodule() -> None:
    check_averages(parse_averages({"generator_ema": ("generator", 0.9)}), Module(), ["generator"], CONFIGS)


def test_an_average_that_is_not_a_submodule_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"`ema=` names 'g_ema', but Module has no submodule.*copy.deepcopy\(self.generator\)"
    ):
        check_average_names(parse_averages({"g_ema": ("generator", 0.9)}), Module())
    check_average_names(parse_averages({"generator_ema": ("generator", 0.9)}), Module())
