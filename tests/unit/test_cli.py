"""The ``lightning-multids`` command's own behaviour: ``export`` errors, ``--ckpt_path last``, import-time setup."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_multids_cli
from lightning_multids._environment import keep_extensions_in_environment
from lightning_multids.cli import main, newest_last_checkpoint
from lightning_multids.utilities.summary import RunSummary, checkpoint_lines, command, shown

REPO = Path(__file__).resolve().parents[2]


def test_export_of_a_missing_checkpoint_is_one_line_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "nowhere.ckpt"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("lightning-multids export: error: The checkpoint ") and "nowhere.ckpt" in error
    assert "ckpt_path" not in error and "Traceback" not in error


def test_export_of_a_directory_that_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "plain"), str(tmp_path / "out")])
    assert "is not a MultiDeepSpeedStrategy checkpoint" in capsys.readouterr().err


def make_checkpoint(path: Path, mtime: float, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    if complete:
        (path / "lightning.pt").write_bytes(b"")
    os.utime(path, (mtime, mtime))
    return path


def test_newest_last_checkpoint_across_versions(tmp_path: Path) -> None:
    assert newest_last_checkpoint(tmp_path) is None
    make_checkpoint(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 100)
    newest = make_checkpoint(tmp_path / "version_1" / "checkpoints" / "last-v1.ckpt", 300)
    make_checkpoint(tmp_path / "version_2" / "checkpoints" / "epoch=3-step=8.ckpt", 400)  # not a last one
    make_checkpoint(tmp_path / "version_3" / "checkpoints" / "last.ckpt", 500, complete=False)  # being written
    make_checkpoint(tmp_path / "version_10" / "checkpoints" / "last.ckpt", 200)
    assert newest_last_checkpoint(tmp_path) == newest
    single = tmp_path / "version_11" / "checkpoints" / "last.ckpt"  # checkpoint_format="file"
    single.parent.mkdir(parents=True)
    single.write_bytes(b"")
    os.utime(single, (600, 600))
    assert newest_last_checkpoint(tmp_path) == single


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    environment.update(env, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120, check=True
    )


@pytest.fixture(scope="module")
def imported() -> subprocess.CompletedProcess[str]:
    """A new interpreter that imports the package, prints what it may have set, then warns as ZeRO's calls do."""
    code = (
        "import logging, os, warnings, lightning_multids\n"
        "print(os.environ.get('TORCH_EXTENSIONS_DIR'))\n"
        "print(len(logging.getLogger('DeepSpeed').filters))\n"
        "warnings.warn('`torch.distributed.all_gather_into_tensor` is deprecated.', FutureWarning)\n"
    )
    return run_python(code)


def test_import_sets_no_environment_variable_and_drops_the_accelerator_guess(
    imported: subprocess.CompletedProcess[str],
) -> None:
    """``import lightning_multids`` leaves no global state: the extensions folder is set by the strategy's start."""
    extensions, filters = imported.stdout.splitlines()[-2:]
    assert extensions == "None"
    assert filters == "0", "the filter must be gone after the import"
    assert "Setting accelerator to CPU" not in imported.stdout + imported.stderr


def test_the_extensions_folder_is_the_environments_until_undone_and_a_users_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    unset = keep_extensions_in_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    unset()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    keep_extensions_in_environment()()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def test_import_installs_no_warning_filter(imported: subprocess.CompletedProcess[str]) -> None:
    """torch's deprecations of DeepSpeed's ZeRO collectives are hidden while engines live, not by ``import``."""
    assert "all_gather_into_tensor" in imported.stderr


def test_run_summary_names_a_command_by_its_path_when_not_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "tensorboard").touch()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert command("tensorboard") == ".venv/bin/tensorboard"
    monkeypatch.setenv("PATH", str(bin_dir))
    (bin_dir / "tensorboard").chmod(0o755)
    assert command("tensorboard") == "tensorboard"
    assert command("not-installed") == "not-installed"


def test_run_summary_shows_the_best_score_with_the_spread_logged_beside_it(tmp_path: Path) -> None:
    """A module that logs ``<monitor>_std`` (the GAN's ``val/kid_std``) gets the best score's spread in the summary."""
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val/kid", filename="best")
    summary = RunSummary()
    for kid, spread in [(30.0, 4.0), (12.3, 1.1), (20.0, 2.0)]:  # one validation each
        metrics = {"val/kid": torch.tensor(kid), "val/kid_std": torch.tensor(spread)}
        summary.on_validation_end(SimpleNamespace(checkpoint_callback=callback, callback_metrics=metrics), None)  # type: ignore[arg-type]
    callback.best_model_path, callback.best_model_score = str(tmp_path / "best.ckpt"), torch.tensor(12.3)
    assert checkpoint_lines(callback, summary.spreads)["Best checkpoint (val/kid)"].endswith(" (12.3 ± 1.1)")
    assert checkpoint_lines(callback)["Best checkpoint (val/kid)"].endswith(" (12.3)")  # no spread logged


def test_run_summary_shows_paths_inside_the_current_directory_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert shown(str(tmp_path / "outputs" / "a.ckpt")) == "outputs/a.ckpt"
    assert shown("/elsewhere/a.ckpt") == "/elsewhere/a.ckpt"


def test_lightning_export_is_weights_only_and_warns_of_frozen_engines_not_saved(tmp_path: Path) -> None:
    """A trained engine saved as weights and a frozen one not saved: one weights-only file, and a warning naming it."""
    import torch

    from lightning_multids.checkpoint import export

    ckpt = tmp_path / "last.ckpt"
    (ckpt / "engines" / "student").mkdir(parents=True)
    torch.save({"weight": torch.ones(2)}, ckpt / "engines" / "student" / "weights.pt")
    lightning = {
        "epoch": 0,
        "global_step": 2,
        "pytorch-lightning_version": "2.6.0",
        "loops": {},
        "callbacks": {"c": 1},
        "optimizer_states": [],
        "lr_schedulers": [],
        "state_dict": {"head.bias": torch.zeros(1)},
        "multids": {"engines": {"student": {"stage": None}}, "frozen": ["teacher"], "averages": {}, "world_size": 2},
    }
    torch.save(lightning, ckpt / "lightning.pt")
    with pytest.warns(UserWarning, match=r"no weights for the frozen engines \['teacher'\].*save_frozen=True"):
        (written,) = export(ckpt, tmp_path / "out", format="lightning")
    saved = torch.load(written)
    assert set(saved) == {"epoch", "global_step", "pytorch-lightning_version", "loops", "state_dict"}
    assert saved["state_dict"].keys() == {"student.weight", "head.bias"}


def test_a_missing_input_file_stops_the_command_before_its_ranks_with_the_message_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    for set_by_the_command in ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(set_by_the_command, "")  # so that monkeypatch puts back what was there before
        monkeypatch.delenv(set_by_the_command)
    command = ["fit", "--config", "configs/distill.yaml", "--model.init_args.teacher_checkpoint=nowhere.ckpt"]
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    shown = str(exit_info.value.code)
    assert shown.startswith("lightning-multids: FileNotFoundError: The teacher checkpoint 'nowhere.ckpt' does not ")
    assert "configs/distill_teacher.yaml` writes it.\n  (in examples/distill.py:" in shown
    assert shown.endswith(", __init__; LIGHTNING_MULTIDS_TRACEBACK=1 shows the traceback)")
    assert not torch.distributed.is_initialized()  # no rank started
    monkeypatch.setenv("LIGHTNING_MULTIDS_TRACEBACK", "1")
    with pytest.raises(ValueError, match="Does not validate") as raised:  # LightningCLI's, around the module's
        main(command)
    assert isinstance(raised.value.__cause__, FileNotFoundError)


def test_an_error_a_traceback_helps_to_find_keeps_it() -> None:
    """A setting, a path, the data or the strategy's refusal: the message; a bug, ours or the user's: a traceback."""
    from lightning_multids._record import EngineRecord, Phase
    from lightning_multids.cli import _misuse, _shown_error

    def raised(call: Callable[[], object]) -> BaseException:
        try:
            call()
        except Exception as error:
            return error
        raise AssertionError("nothing raised")

    def bad_setting() -> None:
        raise ValueError("a setting")

    assert _misuse(raised(bad_setting)) and _misuse(raised(Path("/nowhere/at/all").read_text))
    assert not _misuse(raised(lambda: torch.ones(2) @ torch.ones(3)))  # a shape error in the user's step
    assert not _misuse(raised(lambda: {}["key"])) and not _misuse(raised(lambda: len(3)))  # type: ignore[arg-type]
    record = EngineRecord("g", None, phase=Phase.BACKWARD)  # type: ignore[arg-type]
    assert _misuse(raised(record.refuse_step))  # a refusal of the package's, whatever its type
    record.guard = object()  # type: ignore[assignment]
    assert not _misuse(raised(lambda: setattr(record, "has_gradients", True)))  # a bug in the package's code

    def wrapped() -> None:  # as LightningCLI wraps what the module's `__init__` raised
        try:
            Path("/nowhere/at/all").read_text()
        except OSError as error:
            raise ValueError("Does not validate against any of the Union subtypes") from error

    assert isinstance(_shown_error(raised(wrapped)), FileNotFoundError)
    looped = raised(bad_setting)
    looped.__cause__ = ValueError("outer")
    looped.__cause__.__cause__ = looped
    assert _shown_error(looped) is looped  # a chain that loops back ends


def test_a_distillation_module_builds_without_its_teacher_only_when_told() -> None:
    """``load_from_checkpoint`` of a student where the teacher's checkpoint is gone: ``teacher_checkpoint=None``."""
    from examples.distill import Distillation

    with pytest.raises(FileNotFoundError, match="The teacher checkpoint 'nowhere.ckpt' does not exist"):
        Distillation("nowhere.ckpt", [8], [4])
    Distillation(None, [8], [4]).setup("fit")  # the teacher keeps its initial weights


def test_the_commands_help_lists_lightnings_subcommands_and_export(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    with pytest.raises(SystemExit) as exit_info:
        lightning_multids_cli.main(["--help"])
    assert exit_info.value.code == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.split("subcommands")[1].splitlines()[1:] if line]
    assert listed[: listed.index("export") + 1] == [*LightningCLI.subcommands(), "export"]


def test_the_commands_help_imports_neither_torch_nor_lightning_nor_deepspeed() -> None:
    code = (
        "import sys, lightning_multids_cli\n"
        "try:\n    lightning_multids_cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'lightning', 'deepspeed'} & {name.split('.')[0] for name in sys.modules}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.splitlines()[-1] == "[]"


def test_the_command_without_a_subcommand_shows_the_overview_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        lightning_multids_cli.main([])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "usage: lightning-multids" in error and error.endswith("error: give a subcommand\n")


def test_a_subcommand_and_its_help_run_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    passed: list[list[str]] = []
    monkeypatch.setattr("lightning_multids.cli.main", passed.append)
    for args in (["fit", "--help"], ["export", "a", "b"], ["-c", "x.yaml", "fit"]):
        lightning_multids_cli.main(args)
    assert passed == [["fit", "--help"], ["export", "a", "b"], ["-c", "x.yaml", "fit"]]
