"""Hugging Face engines in checkpoints: what ``export(..., format="hf")`` needs to write ``save_pretrained`` folders.

A checkpoint holds each engine's weights, not its architecture. For an engine whose submodule is a
``transformers.PreTrainedModel``, or a PEFT model around one, saving also writes ``engines/NAME/hf/``: the model's
``config.json``, the PEFT adapter's ``adapter/adapter_config.json``, and ``model.json`` naming the model's class.
Export builds the model from them (no network, no process group), loads the consolidated weights and calls its
``save_pretrained``. ``transformers`` and ``peft`` are imported only for such engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

DESCRIPTION_DIR = "hf"
_MODEL_FILE = "model.json"
_ADAPTER_DIR = "adapter"


def _parts(module: nn.Module) -> tuple[Any, Any] | None:
    """(the ``PreTrainedModel``, the active PEFT adapter's config or None), or None for another module."""
    model: Any = module  # transformers' and peft's attributes, typed there
    origin = type(model).__module__.split(".", 1)[0]
    if origin == "peft" and hasattr(model, "get_base_model"):
        return model.get_base_model(), model.peft_config[model.active_adapter]
    if origin == "transformers" and hasattr(model, "save_pretrained") and hasattr(model, "config"):
        return model, None
    return None


def describe(module: nn.Module, directory: Path) -> bool:
    """Write ``directory`` (config, adapter config, class) if ``module`` is a Hugging Face model; say whether."""
    parts = _parts(module)
    if parts is None:
        return False
    model, adapter = parts
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(directory / "config.json"))
    if adapter is not None:
        adapter.save_pretrained(str(directory / _ADAPTER_DIR))
    (directory / _MODEL_FILE).write_text(json.dumps({"class": type(model).__name__, "peft": adapter is not None}))
    return True


def save_pretrained(
    description: Path, state: dict[str, torch.Tensor], out: Path, *, dtype: torch.dtype, merge_lora: bool
) -> None:
    """Build the model ``description`` names, load ``state`` into it and ``save_pretrained`` it to ``out``.

    A PEFT model is written as its adapter (``adapter_config.json`` and the adapter's weights, to load with
    ``PeftModel.from_pretrained(base, out)``), or with ``merge_lora`` merged into its base model, a plain
    ``transformers`` folder.
    """
    import transformers

    meta = json.loads((description / _MODEL_FILE).read_text())
    config = transformers.AutoConfig.from_pretrained(str(description))
    model: Any = getattr(transformers, meta["class"])(config)
    if meta["peft"]:
        from peft import PeftConfig, get_peft_model

        model = get_peft_model(model, PeftConfig.from_pretrained(str(description / _ADAPTER_DIR)))
    model.load_state_dict(state, strict=True)
    if meta["peft"] and merge_lora:
        model = model.merge_and_unload()
    model.to(dtype).save_pretrained(str(out))
