"""``weights_only`` as torch decides it, and reading a checkpoint directory restricted, DeepSpeed's reads included."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from lightning_multids import _loading as loading
from lightning_multids._compat import deepspeed as ds_compat
from tests.poison import poison


@pytest.mark.parametrize(
    ("weights_only", "environment", "expected"),
    [
        (None, {}, True),
        (True, {}, True),
        (False, {}, False),
        (None, {loading.FORCE_NOT: "1"}, False),
        (True, {loading.FORCE_NOT: "1"}, True),
        (False, {loading.FORCE: "1"}, True),
        (None, {loading.FORCE: "yes"}, True),
    ],
)
def test_restricted_is_what_torch_load_does(
    weights_only: bool | None, environment: dict[str, str], expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (loading.FORCE, loading.FORCE_NOT):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert loading.restricted(weights_only) is expected


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A directory with two torch files: one plain, one holding each DeepSpeed class the list allows."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    root = tmp_path / "ckpt"
    (root / "engines" / "a").mkdir(parents=True)
    torch.save({"weight": torch.ones(2)}, root / "lightning.pt")
    deepspeed_objects = [
        LossScaler(1.0),
        DynamicLossScaler(2.0**16, 1000, 1.0, 2, True, dtype=torch.float16),
        ZeroStageEnum(2),
        fragment_address(4, 0),
    ]
    torch.save({"optimizer_state_dict": deepspeed_objects, "x": torch.zeros(3)}, root / "engines" / "a" / "optim.pt")
    return root


def test_deepspeed_own_classes_load_restricted(checkpoint: Path) -> None:
    with loading.reading(checkpoint, None):
        loaded = torch.load(checkpoint / "engines" / "a" / "optim.pt", weights_only=False)  # as DeepSpeed calls it
    assert [type(o).__name__ for o in loaded["optimizer_state_dict"]] == [
        "LossScaler",
        "DynamicLossScaler",
        "ZeroStageEnum",
        "fragment_address",
    ]
    assert len(ds_compat.checkpoint_globals()) == 4


@pytest.mark.parametrize("weights_only", [None, True])
def test_a_poisoned_file_is_refused_before_anything_loads(
    checkpoint: Path, tmp_path: Path, weights_only: bool | None
) -> None:
    marker = tmp_path / "ran"
    poison(checkpoint / "engines" / "a" / "optim.pt", marker)
    with pytest.raises(pickle.UnpicklingError) as refused, loading.reading(checkpoint, weights_only, opt_out="do X"):
        pytest.fail("the block ran")
    message = str(refused.value)
    assert repr(str(checkpoint / "engines" / "a" / "optim.pt")) in message and "tests.poison.touched" in message
    assert message.endswith("If you trust where this checkpoint came from, do X.")
    assert not marker.exists() and loading.FORCE not in os.environ


def test_torch_load_with_weights_only_false_is_restricted_in_the_block(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed passes ``weights_only=False``; in the block torch still refuses, even what the look missed."""
    marker = tmp_path / "ran"
    poison(checkpoint / "lightning.pt", marker)
    monkeypatch.setattr(torch.serialization, "get_unsafe_globals_in_checkpoint", lambda file: [])
    refused = pytest.raises(pickle.UnpicklingError, match=r"Refusing to load .*ckpt'.*tests.poison.touched.*do X")
    with refused, loading.reading(checkpoint, None, opt_out="do X"):
        torch.load(checkpoint / "lightning.pt", weights_only=False)
    assert not marker.exists() and loading.FORCE not in os.environ


def test_weights_only_false_loads_everything(checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    poison(checkpoint / "lightning.pt", marker)
    with loading.reading(checkpoint, False):
        assert torch.equal(loading.load(checkpoint / "lightning.pt", False)["weight"], torch.ones(2))
    assert marker.exists()


def test_the_environment_is_restored_after_the_block(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(loading.FORCE, "true")
    with loading.reading(checkpoint, None):
        assert os.environ[loading.FORCE] == "1"
    assert os.environ[loading.FORCE] == "true"


def test_unfinished_and_unreadable_files_are_left_to_torch_load(checkpoint: Path, tmp_path: Path) -> None:
    """A killed save or conversion (``*.partial``) is never loaded; a truncated file is torch.load's to refuse."""
    partial = checkpoint / "engines" / "a" / "universal.partial" / "tmp"
    partial.mkdir(parents=True)
    poison(checkpoint / "engines" / "a" / "optim.pt", tmp_path / "ran")  # poisoned, then copied where nothing loads
    (partial / "optim.pt").write_bytes((checkpoint / "engines" / "a" / "optim.pt").read_bytes())
    (partial / "truncated.pt").write_bytes((checkpoint / "lightning.pt").read_bytes()[:40])
    torch.save({"weight": torch.ones(2)}, checkpoint / "engines" / "a" / "optim.pt")  # the loadable one, clean
    (checkpoint / "truncated.pt").write_bytes((checkpoint / "lightning.pt").read_bytes()[:40])
    with loading.reading(checkpoint, None), pytest.raises(RuntimeError):  # torch.load's own error, truncated
        torch.load(checkpoint / "truncated.pt", weights_only=False)


def test_checkpoint_paths_are_local_or_refused() -> None:
    from lightning_multids.checkpoint import local_path

    assert local_path("file:///tmp/run/last.ckpt", "x") == "/tmp/run/last.ckpt"
    assert local_path(Path("file:///tmp/run"), "x") == "/tmp/run"  # a Path keeps one slash: `file:/tmp/run`
    assert local_path("runs/a::b/last.ckpt", "x") == "runs/a::b/last.ckpt"  # a relative path, left as given
    with pytest.raises(ValueError, match=r"^The path 's3://bucket/last.ckpt' is on fsspec's 's3' filesystem.*put\("):
        local_path("s3://bucket/last.ckpt", "The path")


def test_a_poisoned_single_file_checkpoint_is_refused_before_it_unpacks(tmp_path: Path) -> None:
    """A ``checkpoint_format="file"`` checkpoint is looked at as one file, before anything of it is written out."""
    from lightning_multids import checkpoint as checkpoints

    file, marker = tmp_path / "last.ckpt", tmp_path / "ran"
    torch.save({"epoch": 0, "multids": {"files": {"lightning.pt": torch.zeros(1, dtype=torch.uint8)}}}, file)
    poison(file, marker)
    with pytest.raises(
        pickle.UnpicklingError, match=r"Refusing to load .*last.ckpt'.*tests.poison.touched.*weights_only"
    ):
        checkpoints.unpacked(file, None)
    assert not marker.exists()
    unpacked = checkpoints.unpacked(file, False)  # a checkpoint you trust
    assert unpacked is not None and marker.exists()
    assert (Path(unpacked.name) / "lightning.pt").read_bytes() == b"\0"
    unpacked.cleanup()


@pytest.mark.parametrize(
    ("files", "refusal"),
    [
        ({"../escaped": torch.zeros(1, dtype=torch.uint8)}, "outside its directory"),
        ({"": torch.zeros(1, dtype=torch.uint8)}, "outside its directory"),
        ({"lightning.pt": torch.ones(3)}, r"not a file's bytes \(a 1-D uint8 tensor\)"),
        ({"a": torch.zeros(1, dtype=torch.uint8), "a/b": torch.zeros(1, dtype=torch.uint8)}, "cannot be written out"),
    ],
    ids=["traversal", "empty_name", "not_bytes", "file_then_directory"],
)
def test_a_crafted_single_file_is_refused_naming_the_entry(tmp_path: Path, files: dict, refusal: str) -> None:
    from lightning_multids import checkpoint as checkpoints

    file = tmp_path / "last.ckpt"
    torch.save({"epoch": 0, "multids": {"files": files}}, file)
    with pytest.raises(ValueError, match=rf"^(The|A) packed checkpoint file.*{refusal}"):
        checkpoints.unpacked(file, True)
