"""Hugging Face engines in checkpoints: what ``export(..., format="hf")`` needs to write ``save_pretrained`` folders.

A checkpoint holds each engine's weights, not its architecture. For an engine whose submodule is a
``transformers.PreTrainedModel``, or a PEFT model around one, saving also writes ``engines/NAME/hf/``: the model's
``config.json``, each PEFT adapter's ``adapter/NAME/adapter_config.json``, and ``model.json`` naming the model's
class (module and qualified name) and the adapters.
Export builds the model from them (no network, no process group), loads the consolidated weights and calls its
``save_pretrained``. ``transformers`` and ``peft`` are imported only for such engines.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

DESCRIPTION_DIR = "hf"
_MODEL_FILE = "model.json"
_ADAPTER_DIR = "adapter"


def _parts(module: nn.Module) -> tuple[Any, dict[str, Any], str] | None:
    """(the ``PreTrainedModel``, its PEFT adapters' configs by name, the active one), or None for another module."""
    model: Any = module  # transformers' and peft's attributes, typed there
    origin = type(model).__module__.split(".", 1)[0]
    if origin == "peft" and hasattr(model, "get_base_model"):
        active = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
        return model.get_base_model(), dict(model.peft_config), active
    if isinstance(model, _pretrained_model_class()):
        return model, {}, ""
    return None


def _pretrained_model_class() -> type:
    """``transformers.PreTrainedModel`` if transformers is imported already (a model of it exists), else nothing."""
    transformers = sys.modules.get("transformers")
    return transformers.PreTrainedModel if transformers is not None else type(None)


def describe(module: nn.Module, directory: Path) -> bool:
    """Write ``directory`` (config, adapter configs, class) if ``module`` is a Hugging Face model; say whether.

    A model this cannot describe (a config that is not JSON, say) is saved as before, without a description,
    and a warning says that ``export --format hf`` will not write it.
    """
    parts = _parts(module)
    if parts is None:
        return False
    model, adapters, active = parts
    try:
        directory.mkdir(parents=True, exist_ok=True)
        model.config.to_json_file(str(directory / "config.json"))
        for name, adapter in adapters.items():
            adapter.save_pretrained(str(directory / _ADAPTER_DIR / name))
        cls = type(model)
        meta = {"module": cls.__module__, "class": cls.__qualname__, "adapters": list(adapters), "active": active}
        (directory / _MODEL_FILE).write_text(json.dumps(meta))
    except Exception as error:  # noqa: BLE001 - the checkpoint matters more than its description
        shutil.rmtree(directory, ignore_errors=True)
        rank_zero_warn(
            f"The checkpoint does not describe the Hugging Face model {type(model).__name__} ({error}): "
            "`lightning-multids export --format hf` will not write it; its weights are saved as always."
        )
        return False
    return True


def save_pretrained(
    description: Path,
    state: dict[str, torch.Tensor],
    out: Path,
    *,
    dtype: torch.dtype,
    merge_lora: bool,
    trusted: bool = False,
) -> None:
    """Build the model ``description`` names, load ``state`` into it and ``save_pretrained`` it to ``out``.

    A PEFT model is written as its adapters (``adapter_config.json`` and the adapters' weights, to load with
    ``PeftModel.from_pretrained(base, out)``), or with ``merge_lora`` merged into its base model, a plain
    ``transformers`` folder. Raises a ValueError naming the model when it cannot be rebuilt or loaded.

    Unless ``trusted``, the class is imported only from ``transformers`` or from a module already imported: the
    description comes with the checkpoint, and importing a module runs its code.
    """
    meta = json.loads((description / _MODEL_FILE).read_text())
    name = f"{meta['module']}.{meta['class']}"
    if not trusted:
        _refuse_import(meta["module"], name, description)
    try:
        model = _build(description, meta)
        model.load_state_dict(state, strict=True)
    except (ImportError, AttributeError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"Cannot rebuild the Hugging Face model {name} from {str(description)!r} to export it ({error}). "
            "Export it as a state dict (the default format) and load that into your model."
        ) from error
    if meta["adapters"] and merge_lora:
        model = model.merge_and_unload()
    model.to(dtype).save_pretrained(str(out))


def _refuse_import(module: str, name: str, description: Path) -> None:
    """Raise a ValueError if exporting would import ``module`` (not transformers', not imported yet)."""
    if module.split(".", 1)[0] == "transformers" or module in sys.modules:
        return
    raise ValueError(
        f"The checkpoint's description {str(description / _MODEL_FILE)!r} names the model class {name}, whose "
        f"module {module!r} is not imported; importing it would run its code, and an export that does not trust "
        "the checkpoint imports only transformers' own classes. Import the module first (`import "
        f"{module}` before `export(...)`), or if you trust the checkpoint, export with `--unsafe-load` "
        "(`export(..., weights_only=False)`)."
    )


def _build(description: Path, meta: dict[str, Any]) -> Any:
    """The model ``meta`` names, from its saved config, with its PEFT adapters (the active one active)."""
    import transformers

    cls: Any = importlib.import_module(meta["module"])
    for part in meta["class"].split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"{meta['module']}.{meta['class']} is not a transformers.PreTrainedModel")
    model: Any = cls(transformers.AutoConfig.from_pretrained(str(description)))
    if meta["adapters"]:
        from peft import PeftConfig, get_peft_model

        first, *others = meta["adapters"]
        configs = {n: PeftConfig.from_pretrained(str(description / _ADAPTER_DIR / n)) for n in meta["adapters"]}
        model = get_peft_model(model, configs[first], adapter_name=first)
        for adapter in others:
            model.add_adapter(adapter, configs[adapter])
        model.set_adapter(meta["active"])
    return model
