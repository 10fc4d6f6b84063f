"""Pure functions that turn the strategy's arguments into one DeepSpeed config per engine.

Each engine's config is built in three layers, later ones winning key by key:

1. :func:`base_config`: the settings that make DeepSpeed behave like plain PyTorch under Lightning
   (no gradient clipping unless asked, accumulation owned by the training loop, any torch optimizer);
2. the strategy's ``config`` (the default for every engine) and its ``stage``;
3. the engine's entry in ``engine_configs``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepspeed.runtime.config import DtypeEnum

ConfigSource = Mapping[str, Any] | str | Path | None
"""A DeepSpeed config given as a dict, a path to a JSON file, or ``None`` for an empty one."""

VALID_STAGES = (0, 1, 2, 3)

# Precision flags of the Trainer and the DeepSpeed config sections they turn into.
_PRECISION_SECTIONS: dict[str, dict[str, Any]] = {
    "32-true": {},
    "32": {},
    "bf16-mixed": {"bf16": {"enabled": True}},
    "bf16-true": {"bf16": {"enabled": True}},
    "16-mixed": {"fp16": {"enabled": True}},
}


def load_config(source: ConfigSource, *, what: str) -> dict[str, Any]:
    """Read a DeepSpeed config from a dict or a JSON file and return a private deep copy.

    Args:
        source: a mapping, a path to a JSON file, or ``None``.
        what: how to name this config in an error, e.g. ``"the engine 'generator'"``.

    Raises:
        ValueError: the file is missing, is not JSON, or does not hold a JSON object; ``source`` is neither a
            mapping nor a path; a section the strategy reads (``zero_optimization``, ...) is not an object.
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return _checked_sections(copy.deepcopy(dict(source)), what, "")
    if not isinstance(source, str | os.PathLike):
        raise ValueError(
            f"The DeepSpeed config for {what} is a {type(source).__name__} ({source!r}). Pass a dict, "
            'e.g. {"zero_optimization": {"stage": 2}}, or the path of a JSON file holding one.'
        )
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"The DeepSpeed config for {what} points to {str(path)!r}, which is not a file. "
            "Pass an existing JSON file or a dict."
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"The DeepSpeed config for {what} in {str(path)!r} is not valid JSON ({err}). "
            "Fix the file, or pass the config as a dict."
        ) from err
    if not isinstance(loaded, dict):
        raise ValueError(
            f"The DeepSpeed config for {what} in {str(path)!r} holds a {type(loaded).__name__}, "
            'not a JSON object. Write the config as an object: {"zero_optimization": {...}}.'
        )
    return _checked_sections(loaded, what, f" in {str(path)!r}")


_SECTIONS = ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler")  # what the strategy reads
_ZERO_SECTIONS = ("offload_optimizer", "offload_param")


def _example(key: str, value: Any) -> str:
    """How section ``key`` given as ``value`` is written as an object."""
    if key == "zero_optimization":
        return f'{{"stage": {value if value in VALID_STAGES else 2}}}'
    if key in ("bf16", "fp16"):
        return '{"enabled": true}'
    if key.startswith("zero_optimization."):
        return f'{{"device": "{value if value in ("cpu", "nvme") else "cpu"}"}}'
    return '{"type": "...", "params": {...}}'


def _checked_sections(config: dict[str, Any], what: str, where: str) -> dict[str, Any]:
    """``config``, after checking that each section the strategy reads is an object (or, for an offload, null)."""
    zero = config.get("zero_optimization")
    sections = [(key, config[key]) for key in _SECTIONS if key in config]
    if isinstance(zero, Mapping):
        sections += [(f"zero_optimization.{key}", zero[key]) for key in _ZERO_SECTIONS if zero.get(key) is not None]
    for key, value in sections:
        if not isinstance(value, Mapping):
            example = _example(key, value)
            raise ValueError(
                f"The DeepSpeed config for {what}{where} sets `{key}` to {value!r}, but DeepSpeed reads it as an "
                f"object: write `{key.rpartition('.')[2]}: {example}`."
            )
    return config


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated by ``override``, recursing into nested dicts; neither input changes."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def zero_stage(config: Mapping[str, Any]) -> int:
    """The ZeRO stage of a resolved DeepSpeed config."""
    return int(config.get("zero_optimization", {}).get("stage", 0))


def validate_stage(stage: Any, *, what: str) -> int:
    """Return ``stage`` if it is a ZeRO stage (0-3), else raise a ValueError naming ``what``."""
    if isinstance(stage, bool) or stage not in VALID_STAGES:
        raise ValueError(
            f"The ZeRO stage of {what} is {stage!r}; DeepSpeed has stages 0, 1, 2 and 3. "
            'Set `stage=` or `"zero_optimization": {"stage": N}` to one of them.'
        )
    return int(stage)


def base_config(micro_batch_size: int) -> dict[str, Any]:
    """Settings every engine starts from, chosen so DeepSpeed matches plain PyTorch under Lightning.

    * ``gradient_clipping: 0``: DeepSpeed's default is 1.0, which silently clips every step;
      Lightning and PyTorch clip only when asked.
    * ``gradient_accumulation_steps: 1`` and ``managed_gradient_accumulation: false``: the training
      loop owns accumulation (Lightning's ``accumulate_grad_batches`` or N ``manual_backward`` calls
      before ``opt.step()``); a backward only accumulates, ``step()`` is the boundary.
    * ``zero_allow_untested_optimizer``: any ``torch.optim`` optimizer from ``configure_optimizers``.
    * ``train_micro_batch_size_per_gpu``: bookkeeping only (throughput logs); it never scales a gradient.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def precision_section(precision: str) -> dict[str, Any]:
    """Map a Trainer ``precision`` flag to the DeepSpeed config section that implements it."""
    try:
        return copy.deepcopy(_PRECISION_SECTIONS[str(precision)])
    except KeyError:
        supported = ", ".join(repr(p) for p in _PRECISION_SECTIONS)
        raise ValueError(
            f"MultiDeepSpeedStrategy does not support `Trainer(precision={precision!r})`. Use one of {supported}."
        ) from None


def apply_precision(config: Mapping[str, Any], precision: str, *, what: str) -> dict[str, Any]:
    """Add the Trainer's ``precision`` to ``config`` unless the config chooses its own.

    An engine may choose its own precision (``"bf16"``/``"fp16"`` sections, ``enabled`` true or false),
    e.g. a frozen bf16 teacher beside an fp32 student. It may not enable both, nor enable the other
    half precision than the Trainer's (bf16 vs fp16).

    Raises:
        ValueError: the config enables both bf16 and fp16, or contradicts the Trainer's half precision.
    """
    trainer_section = precision_section(precision)
    own = {
        key: bool(config[key].get("enabled", False)) for key in ("bf16", "fp16") if isinstance(config.get(key), Mapping)
    }
    if own.get("bf16") and own.get("fp16"):
        raise ValueError(
            f"The DeepSpeed config for {what} enables both bf16 and fp16. Enable one of them (or neither, for fp32)."
        )
    if not own:
        return merge(config, trainer_section)
    wanted = next(iter(trainer_section), None)  # "bf16", "fp16" or None for fp32
    chosen = next((key for key, enabled in own.items() if enabled), None)
    if wanted is not None and chosen is not None and chosen != wanted:
        raise ValueError(
            f"`Trainer(precision={precision!r})` asks for {wanted}, but the DeepSpeed config for {what} enables "
            f"{chosen}. Remove the engine's `{chosen}` section to follow the Trainer, or change the Trainer's "
            "precision."
        )
    return dict(config)


def engine_config(
    name: str,
    *,
    stage: int,
    default: Mapping[str, Any],
    override: Mapping[str, Any],
    precision: str = "32-true",
    micro_batch_size: int = 1,
    device_type: str | None = None,
) -> dict[str, Any]:
    """Build the full DeepSpeed config of the engine ``name``.

    Args:
        name: the engine's name, for error messages.
        stage: the strategy's default ZeRO stage.
        default: the strategy's default config.
        override: the engine's own entry.
        precision: the Trainer's precision flag.
        micro_batch_size: the per-process batch size, unless a config sets one.
        device_type: ``"cpu"`` or ``"cuda"``: fp16 is refused on a CPU.

    Raises:
        ValueError: the resulting stage is not 0-3, the config asks DeepSpeed to own gradient
            accumulation (``gradient_accumulation_steps`` other than 1), its precision conflicts,
            or it enables fp16 on a CPU.
    """
    what = f"the engine {name!r}"
    user = merge(merge({"zero_optimization": {"stage": stage}}, default), override)
    config = merge(base_config(micro_batch_size), apply_precision(user, precision, what=what))
    validate_stage(config["zero_optimization"].get("stage", 0), what=what)
    steps = config.get("gradient_accumulation_steps", 1)
    if steps != 1:
        raise ValueError(
            f"The DeepSpeed config for {what} sets gradient_accumulation_steps={steps}. Under Lightning the "
            "training loop owns accumulation: remove the setting and use `Trainer(accumulate_grad_batches=N)`, "
            "or call `self.manual_backward(loss / N)` N times before `opt.step()`."
        )
    config.pop("train_batch_size", None)
    if device_type == "cpu" and config.get("fp16", {}).get("enabled"):
        raise ValueError(
            f"The DeepSpeed config for {what} enables fp16, which DeepSpeed does not run on a CPU. Use "
            "`Trainer(precision='bf16-mixed')` (or a `bf16` section in the engine's config) on a CPU; fp16 on a GPU."
        )
    return config


def check_accumulation_dtype(config: Mapping[str, Any], what: str) -> None:
    """Refuse, for a trained engine, ``data_types.grad_accum_dtype`` other than its weights' dtype at ZeRO-0.

    Without ZeRO, DeepSpeed accumulates each gradient in the dtype of its weight, and raises ``NotImplementedError``
    from ``deepspeed.initialize`` when it is given an optimizer and asked otherwise; ZeRO-1 and higher accept the
    setting (bf16 weights' gradients in fp32 at ZeRO-1: ``BF16_Optimizer``). An engine without an optimizer (frozen)
    never reaches that check.
    """
    wanted = (config.get("data_types") or {}).get("grad_accum_dtype")
    if wanted is None or zero_stage(config) != 0:
        return
    enabled = [key for key in ("fp16", "bf16", "bfloat16") if (config.get(key) or {}).get("enabled")]
    weights = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}[enabled[0]] if enabled else "fp32"
    try:
        accumulated = DtypeEnum(wanted).name
    except ValueError:
        return  # DeepSpeed's own config check names what it accepts
    if accumulated != weights:
        raise ValueError(
            f"The DeepSpeed config for {what} sets `data_types.grad_accum_dtype: {wanted!r}` with {weights} weights at "
            f"ZeRO-0, where DeepSpeed accumulates each gradient in its weight's dtype, not in {accumulated}: give the "
            'engine ZeRO-1 or higher (`{"zero_optimization": {"stage": 1}}`), or remove `grad_accum_dtype`.'
        )


FROZEN_ZERO3: dict[tuple[str, str], int] = {
    ("stage3_max_live_parameters", "max_live_parameters"): 0,
    ("stage3_max_reuse_distance", "max_reuse_distance"): 0,
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size"): 0,
}
"""A frozen ZeRO-3 engine's defaults (each key under either of its names in DeepSpeed): no gathered layer kept.

DeepSpeed's defaults (a 5e7-element prefetch bucket, 1e9 elements live, a 1e9 reuse distance) gather the layers
after the one running, so whole layers (a whole model under 5e7 elements) sit beside their partitions during a
forward. With these each layer is gathered for its own forward (or backward) and released after it.
"""

DEEPSPEED_ZERO3 = {
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
}
"""DeepSpeed's own defaults (read from DeepSpeed 0.19.8) of the settings in :data:`FROZEN_ZERO3`: set them in a
frozen engine's ``zero_optimization`` to have it gather ahead as DeepSpeed does."""


def frozen_config(name: str, config: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Adapt an engine config for a frozen engine (no optimizer: inference only).

    ZeRO-1 and -2 partition optimizer state and gradients, which a frozen engine has none of, so they run
    as stage 0 (replicated); stage 3 partitions the parameters and gets :data:`FROZEN_ZERO3` for each of
    those settings that ``config`` does not set.

    Raises:
        ValueError: the engine's own entry asks for gradient clipping or a scheduler, which need an optimizer.
    """
    for key in ("gradient_clipping", "scheduler"):
        if override.get(key):
            raise ValueError(
                f"The engine {name!r} has no optimizer (none in `configure_optimizers`, no `optimizer` section in "
                f"its DeepSpeed config), so its `{key}` setting would do nothing. Remove it, or give the engine "
                "an optimizer."
            )
    frozen = merge(config, {"gradient_clipping": 0.0})
    zero = frozen["zero_optimization"]
    if zero.get("stage", 0) in (1, 2):
        zero["stage"] = 0
    if zero.get("stage") == 3:
        for (key, alias), value in FROZEN_ZERO3.items():
            if key not in zero and alias not in zero:
                zero[key] = value
    return frozen


DEEPSPEED_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` in elements (read from DeepSpeed 0.19.8)."""


def sized_buckets(config: Mapping[str, Any], trainable: int) -> dict[str, Any]:
    """Give a trained engine's reduce bucket at most ``trainable`` elements, unless its config sets the size.

    ZeRO-1, -2 and -3 allocate a buffer of ``reduce_bucket_size`` elements at each backward (two at ZeRO-2 with
    ``overlap_comm``), whatever the engine's size: with DeepSpeed's 5e8 that is 954 MiB in bf16 (1.9 GiB at
    ZeRO-1, which stages in fp32). An engine with ``trainable`` elements of gradients never fills more than
    that, so a smaller bucket reduces the same gradients in the same calls with less memory.
    """
    sized = merge(config, {})
    zero = sized["zero_optimization"]
    if zero.get("stage", 0) in (1, 2, 3) and "reduce_bucket_size" not in zero:
        zero["reduce_bucket_size"] = max(1, min(DEEPSPEED_REDUCE_BUCKET, trainable))
    return sized


_INIT_SETTINGS = (("fp16", "enabled"), ("bf16", "enabled"), ("zero_optimization", "offload_param"))
"""What ``deepspeed.zero.Init`` reads from a config when it partitions new parameters: their dtype and place."""


def zero3_init_config(
    stage: int, default: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]], precision: str
) -> dict[str, Any] | None:
    """The config for ``deepspeed.zero.Init`` in ``configure_model``, or None when no engine can be ZeRO-3.

    Each engine's stage is resolved as for its engine (``stage``, then ``config``, then its entry); a
    submodule without an entry gets the default. The ZeRO-3 engines with an entry must agree on what
    ``zero.Init`` reads (dtype, ``offload_param``): one ``zero.Init`` builds every submodule of
    ``configure_model``. The default's config is used only when no entry is ZeRO-3.

    Raises:
        ValueError: two ZeRO-3 candidates disagree on one of those settings.
    """
    candidates = {
        "every engine without an entry": engine_config(
            "default", stage=stage, default=default, override={}, precision=precision
        ),
        **{
            f"the engine {name!r}": engine_config(
                name, stage=stage, default=default, override=override, precision=precision
            )
            for name, override in overrides.items()
        },
    }
    zero3 = {who: config for who, config in candidates.items() if config["zero_optimization"].get("stage") == 3}
    if len(zero3) > 1:  # the default serves only submodules without an entry, which may not exist: entries decide
        zero3.pop("every engine without an entry", None)
    if not zero3:
        return None
    (first, chosen), *others = zero3.items()
    for who, config in others:
        for section, key in _INIT_SETTINGS:
            mine, theirs = config.get(section, {}).get(key), chosen.get(section, {}).get(key)
            if mine != theirs:
                raise ValueError(
                    f"ZeRO-3 builds the submodules of `configure_model` with one `deepspeed.zero.Init`, but {first} "
                    f"sets `{section}.{key}` to {theirs!r} and {who} to {mine!r}. Give every ZeRO-3 engine the same "
                    f"`{section}.{key}`, or build the ones that differ in `__init__` instead of `configure_model`."
                )
    return chosen
