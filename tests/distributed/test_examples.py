"""Every example config runs a few steps on 2 CPU processes through the ``lightning-multids`` command.

Each test copies ``configs/`` into a temporary directory and runs the command there, as a user would from the
repository root, so every output (logs, checkpoints) lands in the temporary directory. The GAN's tests, which check
the command itself (what it prints, errors shown once, what it warns), run the console script, and Lightning's own
launcher starts the second process; the run they share is resumed on forked ranks. The examples' own runs (marked
``examples``; ``make test-quick`` leaves them out) call the command's entry point on ranks forked by the harness
(:func:`on_forked_ranks`): the same code, without a new interpreter per rank.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.distributed.harness import REPO, free_port, run_ranks

SCRIPT = Path(sys.executable).with_name("lightning-multids")
# The console script of this environment; where the package is only on PYTHONPATH (the GPU machine), the module.
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "lightning_multids.cli"]
CLI_RANK = Path(__file__).with_name("_cli_rank.py")
SHORT = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2"]
SHORT += ["--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1"]


AVOIDABLE = [
    "Setting accelerator to CPU",  # DeepSpeed's guess, which the strategy overrides anyway
    "not recommended to provide both args and command line arguments",  # LightningCLI, when given sys.argv
    "exists and is not empty",  # Lightning, for a checkpoint folder shared by several configs
    "Processing zero checkpoint",  # DeepSpeed, merging ZeRO partitions when weights are loaded or exported
    "is deprecated. Please use `torch.distributed",  # torch 2.13, at each of DeepSpeed's ZeRO collectives
    "try installing [litlogger]",  # Lightning's tip, at Trainer(...)
    "try installing [litmodels]",  # Lightning's tip, at fit, where a config has no ModelCheckpoint
    "`isinstance(treespec, LeafSpec)` is deprecated",  # torch 2.13, at Lightning's CombinedLoader
    "module(s) in eval mode at the start of training",  # Lightning, for frozen engines and the GAN's classifier
]
"""What the command printed once and must not print again: each is prevented by the project (the last five by
:mod:`lightning_multids._noise`)."""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    return tmp_path


def lightning_multids(workdir: Path, *args: str, timeout: float = 300, returncode: int = 0) -> str:
    """Run the console script in ``workdir``; return its output, or fail with it (also on a hang).

    No second try where the port was taken (as the harness's launches have): rank 0 then fails at once, but
    Lightning's launcher leaves rank 1 waiting for it, and the run fails at ``timeout``.
    """
    command = " ".join(args)
    code, output = _console_script(workdir, args, timeout)
    assert code == returncode, f"lightning-multids {command} exited {code}:\n{output[-6000:]}"
    for avoidable in AVOIDABLE:
        assert avoidable not in output, f"lightning-multids {command} printed {avoidable!r}:\n{output[-6000:]}"
    return output


def _console_script(workdir: Path, args: tuple[str, ...], timeout: float) -> tuple[int, str]:
    """The console script's exit status and output, on a port free when chosen; a hang fails."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # the GPU machine's packages too
    env = dict(os.environ, PYTHONPATH=path, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [*CLI, *args],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the launched rank joins this process group, so a timeout kills both
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        command = " ".join(args)
        raise AssertionError(f"lightning-multids {command} did not finish in {timeout} s:\n{output[-4000:]}") from None
    return proc.returncode, output


def on_forked_ranks(workdir: Path, *args: str, world_size: int = 2) -> str:
    """Run the command's entry point in ``workdir`` on ranks forked by the harness; every rank's output, in order.

    For the examples' runs and a resume: the command as a user runs it, less Lightning's launcher and a new
    interpreter per rank, which :func:`lightning_multids` keeps (with what the command must not print).
    """
    output = "".join(run_ranks(CLI_RANK, str(workdir), *args, world_size=world_size, timeout=240))
    for avoidable in AVOIDABLE:
        assert avoidable not in output, f"lightning-multids {' '.join(args)} printed {avoidable!r}:\n{output[-6000:]}"
    return output


def summary_line(output: str, label: str) -> str | None:
    """The text of ``label``'s line in the summary a run ends with (``RunSummary``), or None if it has none."""
    line = re.search(rf"^{re.escape(label)}: +(.*)$", output, re.M)
    return line.group(1) if line is not None else None


def events(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The GAN config's short run, with ``--ckpt_path last`` and no run before it: its folder and output.

    One run for the tests of what the command prints, logs and saves, and of resuming the newest run after it.
    """
    workdir = tmp_path_factory.mktemp("gan")
    shutil.copytree(REPO / "configs", workdir / "configs")
    progress = "--trainer.enable_progress_bar=true"  # as lines: the output is not a terminal
    return workdir, lightning_multids(
        workdir, "fit", "--config", "configs/gan.yaml", *SHORT, progress, "--ckpt_path", "last"
    )


def test_gan_config_trains_and_logs_curves_kid_and_a_sample_grid(gan_run: tuple[Path, str]) -> None:
    workdir, output = gan_run
    log_dir = workdir / "outputs" / "gan" / "gan" / "version_0"
    assert summary_line(output, "Engines (ZeRO stage)") == "{'generator': 1, 'discriminator': 2, 'generator_ema': 3}"
    assert "tensorboard --logdir outputs/gan" in output
    tags = events(log_dir).Tags()
    shares = {f"digits/{digit}" for digit in range(10)}
    logged = {"train/d_loss", "train/g_loss", "val/kid", "val/kid_std", "val/rarest_digit", "val/diversity", *shares}
    assert logged <= set(tags["scalars"]), tags
    assert re.search(r"^Digits drawn: +0: \d+\.\d%  1: .*  9: \d+\.\d% \(of 2000, by the classifier\)$", output, re.M)
    assert "samples" in tags["images"], tags
    assert (log_dir / "samples.png").is_file()
    assert (log_dir / "checkpoints" / "last.ckpt" / "lightning.pt").is_file()
    assert (log_dir / "checkpoints" / "last.ckpt" / "engines" / "generator_ema" / "weights.pt").is_file()  # the EMA
    best = "outputs/gan/gan/version_0/checkpoints/best.ckpt"  # the lowest KID, which the summary says to export
    assert (workdir / best / "lightning.pt").is_file()
    assert re.search(rf"^Best checkpoint \(val/kid\): +{best} \([-\d.e+]+ ± [-\d.e+]+\)$", output, re.M), output
    # One progress line per epoch (the run's output is not a terminal), with the validation's figures.
    progress = [line for line in output.splitlines() if line.startswith("epoch 1/1 ")]
    assert [line for line in progress if " val/kid_std " in line] == progress[-1:], progress
    assert re.fullmatch(r"epoch 1/1  done  step 6  .*  val/kid [-\d.e+]+  val/kid_std [-\d.e+]+  .*", progress[-1])
    assert re.search(rf"^Export weights: +\S+ export {best} ", output, re.M), output
    assert (log_dir / "config.yaml").is_file()  # LightningCLI saved the resolved config


@pytest.mark.examples
def test_distillation_configs_chain_teacher_student_and_test(workdir: Path) -> None:
    distill = workdir / "outputs" / "distill"
    on_forked_ranks(workdir, "fit", "--config", "configs/distill_teacher.yaml", *SHORT)
    assert (distill / "teacher" / "checkpoints" / "teacher.ckpt" / "lightning.pt").is_file()
    output = on_forked_ranks(workdir, "fit", "--config", "configs/distill.yaml", *SHORT)
    assert summary_line(output, "Engines (ZeRO stage)") == "{'student': 2, 'teacher': 3}"
    tags = events(workdir / "outputs" / "distill" / "distilled" / "version_0").Tags()["scalars"]
    assert {"train/loss", "val/accuracy", "val/teacher_accuracy"} <= set(tags), tags
    ckpt = str(distill / "distilled" / "checkpoints" / "distilled.ckpt")
    output = on_forked_ranks(
        workdir, "test", "--config", "configs/distill.yaml", f"--ckpt_path={ckpt}", "--trainer.devices=1", world_size=1
    )
    assert "test/accuracy" in output
    exported = workdir / "exported"
    on_forked_ranks(workdir, "export", ckpt, str(exported), world_size=1)
    student = torch.load(exported / "student.pt")
    assert student["net.0.weight"].shape == (16, 64)


def test_distillation_before_its_teacher_says_to_train_the_teacher_first(workdir: Path) -> None:
    output = lightning_multids(workdir, "fit", "--config", "configs/distill.yaml", *SHORT, returncode=1)
    teacher = "outputs/distill/teacher/checkpoints/teacher.ckpt"
    message = f"The teacher checkpoint '{teacher}' does not exist. Train the teacher"
    assert output.startswith(f"Seed set to 0\nlightning-multids: FileNotFoundError: {message}"), output[-3000:]
    assert "configs/distill_teacher.yaml" in output and "examples/distill.py:" in output
    assert "[rank" not in output and "Traceback" not in output  # stopped before the ranks, as a message
    assert "Does not validate against any of the Union subtypes" not in output  # the parser's wrapping of it


@pytest.mark.examples
def test_student_alone_config_trains(workdir: Path) -> None:
    on_forked_ranks(workdir, "fit", "--config", "configs/distill_student.yaml", *SHORT)
    assert (workdir / "outputs" / "distill" / "student" / "checkpoints" / "student.ckpt" / "lightning.pt").is_file()


@pytest.mark.examples
def test_rlhf_config_trains_four_engines(workdir: Path) -> None:
    output = on_forked_ranks(workdir, "fit", "--config", "configs/rlhf.yaml", *SHORT)
    assert summary_line(output, "Engines (ZeRO stage)") == "{'actor': 3, 'critic': 1, 'reference': 3, 'reward': 3}"
    tags = events(workdir / "outputs" / "rlhf" / "rlhf" / "version_0").Tags()["scalars"]
    assert {"train/reward", "train/kl", "train/actor_loss", "train/critic_loss", "val/reward"} <= set(tags), tags


@pytest.mark.examples
def test_contrastive_config_trains_with_grad_cache(workdir: Path) -> None:
    output = on_forked_ranks(workdir, "fit", "--config", "configs/contrastive.yaml", *SHORT)
    assert summary_line(output, "Engines (ZeRO stage)") == "{'image_encoder': 2, 'profile_encoder': 3}"
    tags = events(workdir / "outputs" / "contrastive" / "contrastive" / "version_0").Tags()["scalars"]
    assert {"train/loss", "val/recall@1"} <= set(tags), tags


@pytest.mark.examples
def test_language_model_configs_chain_teacher_students_and_dpo(workdir: Path) -> None:
    on_forked_ranks(workdir, "fit", "--config", "configs/lm_distill_teacher.yaml", *SHORT)
    output = on_forked_ranks(workdir, "fit", "--config", "configs/lm_distill.yaml", *SHORT)
    assert summary_line(output, "Engines (ZeRO stage)") == "{'student': 2, 'alone': 2, 'teacher': 3}"
    assert re.search(r"^Held-out perplexity: +teacher [\d.]+, student [\d.]+, alone [\d.]+ \(per byte\)$", output, re.M)
    assert re.search(r"^Generated \(teacher\): +'Return the ", output, re.M)
    output = on_forked_ranks(workdir, "fit", "--config", "configs/dpo.yaml", *SHORT)
    assert summary_line(output, "Engines (ZeRO stage)") == "{'policy': 2, 'reference': 3}"
    assert re.search(r"^Held-out preference: +accuracy [\d.]+, reward margin -?[\d.]+$", output, re.M)
    assert re.fullmatch(r"policy [\d.]+, reference [\d.]+", summary_line(output, "True continuation preferred") or "")
    tags = events(workdir / "outputs" / "lm" / "dpo" / "version_0").Tags()["scalars"]
    assert {"train/loss", "train/reward_margin", "train/accuracy", "val/accuracy"} <= set(tags), tags
    # Distilling further with LoRA: both students start from the distilled one and train adapters only.
    again = workdir / "again"
    shutil.copytree(workdir / "configs", again / "configs")
    shutil.copytree(workdir / "outputs" / "lm" / "teacher", again / "outputs" / "lm" / "teacher")
    shutil.copytree(workdir / "outputs" / "lm" / "distilled" / "checkpoints" / "distilled.ckpt", again / "start.ckpt")
    lora = ["--model.student_checkpoint=start.ckpt", "--model.lora_rank=4"]
    output = on_forked_ranks(again, "fit", "--config", "configs/lm_distill.yaml", *SHORT, *lora)
    assert re.search(r"^Held-out perplexity: +teacher [\d.]+, student [\d.]+, alone [\d.]+ \(per byte\)$", output, re.M)
    ckpt = str(again / "outputs" / "lm" / "distilled" / "checkpoints" / "distilled.ckpt")
    on_forked_ranks(again, "export", ckpt, str(again / "exported"), "--format", "hf", world_size=1)
    assert (again / "exported" / "student" / "adapter_config.json").is_file()  # an adapter, not a whole model


UPSTREAM_WARNINGS = [
    "does not have many workers",  # on a machine with 6 or more CPUs
    "GPU available but not used",  # the config's `accelerator: cpu` on a machine with a GPU
]
"""The warnings a short fit may print that are not the project's, each listed in docs/errors.md."""


def test_a_fit_warns_only_what_the_errors_guide_lists(gan_run: tuple[Path, str]) -> None:
    """Every warning line of the GAN's short run (``path.py:LINE: message``) is one docs/errors.md lists."""
    _, output = gan_run
    guide = (REPO / "docs" / "errors.md").read_text()
    assert all(warning in guide for warning in UPSTREAM_WARNINGS), "list each in docs/errors.md"
    warnings = [line for line in output.splitlines() if re.match(r".+?\.py:\d+: ", line)]
    unlisted = [line for line in warnings if not any(known in line for known in UPSTREAM_WARNINGS)]
    assert not unlisted, unlisted


def test_ckpt_path_last_resumes_the_newest_run_of_the_logger(gan_run: tuple[Path, str]) -> None:
    """Each run logs into a new version folder; ``--ckpt_path last`` finds the previous one's last checkpoint."""
    workdir, output = gan_run
    assert "no last checkpoint under outputs/gan/gan/*/checkpoints, so this run starts from scratch" in output
    assert "HINT" not in output  # Lightning's hint to set save_last, which the config sets
    first = Path("outputs/gan/gan/version_0/checkpoints/last.ckpt")
    # One epoch more than the first run's; the command's entry point on forked ranks (resolving `last` is the CLI's).
    further = [*SHORT, "--trainer.max_epochs=2", "--ckpt_path", "last"]
    output = on_forked_ranks(workdir, "fit", "--config", "configs/gan.yaml", *further)
    assert f"last checkpoint under outputs/gan/gan/*/checkpoints, resuming from {first}" in output
    assert f"Restoring states from the checkpoint path at {first}" in output  # Lightning's own line
    # Nothing left to train from the newest checkpoint (the demo's 40 epochs resumed with max_epochs=8, or 40):
    # one line, and no new folder.
    versions = sorted(p.name for p in (workdir / "outputs" / "gan" / "gan").iterdir())
    output = lightning_multids(workdir, "fit", "--config", "configs/gan.yaml", *further, returncode=2)  # done
    assert "which goes on at epoch 3, and --trainer.max_epochs=2 ends training before it" in output, output
    assert "Traceback" not in output
    assert sorted(p.name for p in (workdir / "outputs" / "gan" / "gan").iterdir()) == versions


def test_an_error_is_shown_once_with_every_ranks_line(workdir: Path) -> None:
    bad = "--trainer.strategy.init_args.engine_configs={'gen': {}}"
    output = lightning_multids(workdir, "fit", "--config", "configs/gan.yaml", *SHORT, bad, returncode=1)
    message = "`engine_configs` has an entry for 'gen', but DigitsGAN has no submodule of that name"
    assert f"[rank 0] MultiDeepSpeedStrategy: ValueError: {message}" in output
    assert f"[rank 1] MultiDeepSpeedStrategy: ValueError: {message}" in output
    assert output.count(message) == 2 and "Traceback" not in output, output  # a user's error: no traceback
    shown = r"^lightning-multids: stopped by the error above \(in .*LIGHTNING_MULTIDS_TRACEBACK=1"
    assert re.search(shown, output, re.M), output
