"""A checkpoint loads as ``weights_only`` says, every part of it: a poisoned part runs nothing unless trusted.

As ``torch.load`` and Lightning's own strategies: with ``weights_only=True`` or the default, a file holding anything
but tensors and plain types is refused and the error names it; with ``weights_only=False`` it loads.

The rank code, run on 2 ranks: :func:`train` runs one epoch of a distillation with a frozen ZeRO-3 teacher (saved:
``save_frozen=True``), a ZeRO-2 Adam student and its EMA, saved by ``ModelCheckpoint`` to ROOT/ckpts/last.ckpt.
:func:`load_cases` runs, for each CASE ``NAME:WEIGHTS_ONLY:CALL[:bypass][:no-ema]`` (WEIGHTS_ONLY ``none``,
``true`` or ``false``; CALL ``fit`` or ``validate``), ``trainer.CALL(ckpt_path=ROOT/cases/NAME/last.ckpt,
weights_only=...)``; each rank returns {NAME: ``ok`` or ``ErrorType: message``}. With ``bypass`` the strategy's look
at the pickles before loading finds nothing, so only torch's restricted unpickler, DeepSpeed's reads included,
stands in the way; with ``no-ema`` the module has no ``student_ema`` and the strategy no ``ema=``.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids.cli import main
from tests import patterns
from tests.distributed.common import cpu_trainer, sharded_loader
from tests.distributed.harness import REPO, on_ranks
from tests.poison import poison

WEIGHTS_ONLY = {"none": None, "true": True, "false": False}


class Distill(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.teacher, self.student = patterns.make_distill_modules()
        self.student_ema = copy.deepcopy(self.student)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        patterns.distill_step(self.teacher, self.student, batch, self.optimizers(), self.manual_backward)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_gap", (self.student_ema(batch[:, :6]) - self.teacher(batch[:, :6])).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return patterns.make_optimizer("adam", self.student.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return sharded_loader(self, patterns.make_batches(2))

    val_dataloader = train_dataloader


def trainer(root: Path, epochs: int, ema: bool = True) -> pl.Trainer:
    strategy = MultiDeepSpeedStrategy(
        stage=2,
        engine_configs={"teacher": {"zero_optimization": {"stage": 3}}},
        ema={"student_ema": ("student", 0.9)} if ema else None,
        save_frozen=True,
    )
    checkpoints = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, save_top_k=0)
    return cpu_trainer(strategy, max_epochs=epochs, use_distributed_sampler=False, callbacks=[checkpoints])


def load(root: Path, case: str) -> str:
    name, weights_only, call, *flags = case.split(":")
    path = str(root / "cases" / name / "last.ckpt")
    t = trainer(root / "cases" / name / "run", 2, ema="no-ema" not in flags)
    module = Distill()
    if "no-ema" in flags:
        del module.student_ema
    scan = mock.patch("torch.serialization.get_unsafe_globals_in_checkpoint", return_value=[])
    try:
        with scan if "bypass" in flags else mock.patch.dict({}):
            getattr(t, call)(module, ckpt_path=path, weights_only=WEIGHTS_ONLY[weights_only])
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}".replace("\n", " ")
    return "ok"


def train(root: Path) -> None:
    """On each rank: one epoch, checkpointed to ROOT/ckpts/last.ckpt."""
    trainer(root, 1).fit(Distill())


def load_cases(root: Path, cases: list[str]) -> dict[str, str]:
    """On each rank: each case loaded in turn; its result by its name."""
    return {case.split(":")[0]: load(root, case) for case in cases}


PARTS = {
    "lightning": "lightning.pt",
    "model_states": "engines/student/state/mp_rank_00_model_states.pt",
    "optimizer_states": "engines/student/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "frozen_weights": "engines/teacher/weights.pt",
    "ema_weights": "engines/student_ema/weights.pt",
}
"""Each kind of file in a checkpoint of :class:`Distill`, by the name of its case."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights_only")
    on_ranks(train, root)
    assert sorted(str(p.relative_to(root / "ckpts" / "last.ckpt")) for p in (root / "ckpts").rglob("*.pt")) == sorted(
        [*PARTS.values(), "engines/student/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    )
    return root


def poisoned_copy(root: Path, name: str, part: str) -> tuple[Path, Path]:
    """ROOT/cases/NAME/last.ckpt, a copy of the trained checkpoint with ``part`` poisoned; and its marker."""
    copy = root / "cases" / name / "last.ckpt"
    shutil.copytree(root / "ckpts" / "last.ckpt", copy)
    marker = root / "cases" / f"{name}.ran"
    poison(copy / part, marker)
    return copy / part, marker


def test_every_poisoned_part_is_refused_unless_weights_only_is_false(trained: Path) -> None:
    cases, expected = [], {}
    for part, file in PARTS.items():
        for weights_only in ("none", "true", "false"):
            name = f"{part}-{weights_only}"
            expected[name] = poisoned_copy(trained, name, file)
            cases.append(f"{name}:{weights_only}:fit")
    for name, call in (("validate-none", "validate:none"), ("validate-false", "validate:false")):
        expected[name] = poisoned_copy(trained, name, PARTS["ema_weights"])
        cases.append(f"{name}:{call.split(':')[1]}:validate")
    for rank, results in enumerate(on_ranks(load_cases, trained, cases, timeout=600)):
        assert sorted(results) == sorted(expected), results
        for name, (file, marker) in expected.items():
            if name.endswith("-false"):
                assert results[name] == "ok", f"rank {rank}, {name}: {results[name]}"
                assert marker.exists(), f"{name}: weights_only=False loads every object, as torch.load does"
                continue
            assert not marker.exists(), f"{name}: the poisoned file ran code"
            message = results[name]
            assert message.startswith("UnpicklingError: Refusing to load"), f"rank {rank}, {name}: {message}"
            assert repr(str(file)) in message and "tests.poison.touched" in message, message
            assert "pass `weights_only=False` to `trainer.fit`" in message, message


def test_restricted_loading_does_not_depend_on_the_look_before_loading(trained: Path) -> None:
    """With the look at the pickles blinded, torch's restricted unpickler refuses the file DeepSpeed reads itself.

    DeepSpeed reads the model states on every rank (``torch.load(..., weights_only=False)`` in its code).
    """
    file, marker = poisoned_copy(trained, "bypassed", PARTS["model_states"])
    for results in on_ranks(load_cases, trained, ["bypassed:none:fit:bypass"]):
        message = results.get("bypassed")
        assert message is not None, results
        assert message.startswith("UnpicklingError: Refusing to load"), message
        assert str(file.parents[3]) in message and "tests.poison.touched" in message
    assert not marker.exists()


def test_a_saved_average_whose_submodule_is_gone_is_refused_with_strict_loading(trained: Path) -> None:
    shutil.copytree(trained / "ckpts" / "last.ckpt", trained / "cases" / "no-ema" / "last.ckpt")
    for results in on_ranks(load_cases, trained, ["no-ema:none:fit:no-ema"]):
        message = results.get("no-ema")
        assert message is not None, results
        expected = r"ValueError: The checkpoint .* holds the weights of the submodule 'student_ema', which this"
        assert re.match(expected, message), message


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``lightning-multids export ARGS`` run in this process: its exit status and what it wrote to stderr."""
    try:
        main(["export", *args])
    except SystemExit as exit:
        return int(exit.code or 0), capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.parametrize("part", sorted(PARTS))
def test_export_refuses_a_poisoned_part_unless_unsafe_load(
    trained: Path, part: str, capsys: pytest.CaptureFixture[str]
) -> None:
    file, marker = poisoned_copy(trained, f"export-{part}", PARTS[part])
    out = trained / "exported" / part
    args = [str(trained / "cases" / f"export-{part}" / "last.ckpt"), str(out)]
    status, stderr = export(capsys, *args)
    assert status == 2, stderr[-3000:]
    assert "Refusing to load" in stderr and repr(str(file)) in stderr, stderr[-3000:]
    assert "--unsafe-load" in stderr
    assert not marker.exists() and not out.exists()
    status, stderr = export(capsys, *args, "--unsafe-load")
    assert status == 0, stderr[-3000:]
    assert marker.exists()
    assert sorted(p.name for p in out.iterdir()) == ["plain.pt", "student.pt", "student_ema.pt", "teacher.pt"]


def test_the_export_command_shows_the_refusal_without_a_traceback(trained: Path) -> None:
    """The command itself, in a new process (the test above calls it in this one): exit status 2 and one message."""
    file, marker = poisoned_copy(trained, "export-command", PARTS["model_states"])
    checkpoint = trained / "cases" / "export-command" / "last.ckpt"
    command = [sys.executable, "-m", "lightning_multids.cli", "export", str(checkpoint), str(trained / "out")]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Refusing to load" in refused.stderr and repr(str(file)) in refused.stderr, refused.stderr[-3000:]
    assert "--unsafe-load" in refused.stderr and "Traceback" not in refused.stderr
    assert not marker.exists()
