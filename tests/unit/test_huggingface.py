"""Hugging Face engines' descriptions in checkpoints, and the ``save_pretrained`` folders export builds from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

from lightning_multids import _huggingface as huggingface  # noqa: E402
from tests.distributed import test_hf  # noqa: E402

PROMPT = test_hf.PROMPT


class TinyGPT2(GPT2LMHeadModel):
    """A user's own subclass of a transformers model, outside the transformers package."""


def lora(seed: int) -> LoraConfig:
    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], init_lora_weights=False)


def base(cls: type = GPT2LMHeadModel) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return cls(test_hf.config())


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def export(model: torch.nn.Module, tmp_path: Path, merge_lora: bool = False) -> Path:
    """What a save then ``export --format hf`` do with ``model``'s description and weights."""
    assert huggingface.describe(model, tmp_path / "hf")
    huggingface.save_pretrained(
        tmp_path / "hf", model.state_dict(), tmp_path / "out", dtype=torch.float32, merge_lora=merge_lora
    )
    return tmp_path / "out"


def test_an_adapter_not_named_default_is_exported_under_its_name(tmp_path: Path) -> None:
    model = get_peft_model(base(), lora(1), adapter_name="policy")
    out = export(model, tmp_path)
    loaded = PeftModel.from_pretrained(base(), out / "policy", "policy")  # PEFT keeps other names in subfolders
    assert (logits(loaded) - logits(model)).abs().max().item() <= 1e-5
    assert (logits(loaded) - logits(base())).abs().max().item() > 1e-3  # the adapter changes the logits


def test_several_adapters_merge_the_active_one(tmp_path: Path) -> None:
    model = get_peft_model(base(), lora(1), adapter_name="policy")
    model.add_adapter("value", lora(2))
    model.set_adapter("value")
    merged = GPT2LMHeadModel.from_pretrained(export(model, tmp_path, merge_lora=True))
    assert (logits(merged) - logits(model)).abs().max().item() <= 1e-5


def test_a_class_outside_transformers_top_level_is_rebuilt(tmp_path: Path) -> None:
    model = base(TinyGPT2)
    assert json.loads((export(model, tmp_path) / "config.json").read_text())["architectures"] == ["TinyGPT2"]
    loaded = TinyGPT2.from_pretrained(tmp_path / "out")
    assert (logits(loaded) - logits(model)).abs().max().item() <= 1e-6


def test_a_config_that_is_not_json_is_saved_without_a_description(tmp_path: Path) -> None:
    model = base()
    model.config.class_weights = torch.ones(3)
    with pytest.warns(UserWarning, match="does not describe the Hugging Face model GPT2LMHeadModel.*weights are saved"):
        assert not huggingface.describe(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_model_that_cannot_be_rebuilt_is_a_value_error_naming_it(tmp_path: Path) -> None:
    model = base()
    assert huggingface.describe(model, tmp_path / "hf")
    meta = json.loads((tmp_path / "hf" / "model.json").read_text())
    (tmp_path / "hf" / "model.json").write_text(json.dumps({**meta, "module": "gone.models", "class": "Gone"}))
    with pytest.raises(ValueError, match=r"Cannot rebuild the Hugging Face model gone.models.Gone .*state dict"):
        huggingface.save_pretrained(
            tmp_path / "hf", model.state_dict(), tmp_path / "out", dtype=torch.float32, merge_lora=False, trusted=True
        )


def describe_as(tmp_path: Path, module: str, cls: str) -> dict[str, torch.Tensor]:
    """A description in ``tmp_path/hf`` whose model.json names ``module.cls``; the model's weights."""
    model = base()
    assert huggingface.describe(model, tmp_path / "hf")
    meta = json.loads((tmp_path / "hf" / "model.json").read_text())
    (tmp_path / "hf" / "model.json").write_text(json.dumps({**meta, "module": module, "class": cls}))
    return model.state_dict()


def test_an_untrusted_description_imports_no_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The class a checkpoint names is imported only from transformers or an imported module, unless trusted."""
    marker = tmp_path / "imported"
    (tmp_path / "planted_models.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Model: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    state = describe_as(tmp_path, "planted_models", "Model")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"names the model class planted_models.Model.*not imported.*--unsafe-load"):
        huggingface.save_pretrained(tmp_path / "hf", state, out, dtype=torch.float32, merge_lora=False)
    assert not marker.exists() and not out.exists()
    monkeypatch.delitem(sys.modules, "planted_models", raising=False)  # imported below; gone after the test
    with pytest.raises(ValueError, match=r"Cannot rebuild .*planted_models.Model is not a transformers.PreTrained"):
        huggingface.save_pretrained(tmp_path / "hf", state, out, dtype=torch.float32, merge_lora=False, trusted=True)
    assert marker.exists() and not out.exists()


def test_a_named_callable_that_is_not_a_model_class_is_never_called(tmp_path: Path) -> None:
    state = describe_as(tmp_path, "os", "system")  # imported already, so allowed as a module
    with pytest.raises(ValueError, match=r"Cannot rebuild .*os.system is not a transformers.PreTrainedModel"):
        huggingface.save_pretrained(tmp_path / "hf", state, tmp_path / "out", dtype=torch.float32, merge_lora=False)


def test_other_modules_are_not_described(tmp_path: Path) -> None:
    assert not huggingface.describe(torch.nn.Linear(2, 2), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
