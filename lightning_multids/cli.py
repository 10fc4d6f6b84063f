"""The ``lightning-multids`` command: Lightning's CLI (``fit``, ``validate``, ``test``, ``predict``) plus ``export``.

``lightning-multids fit --config configs/gan.yaml`` is ``LightningCLI`` with any LightningModule and
LightningDataModule given by ``class_path`` in the YAML, and :class:`~lightning_multids.MultiDeepSpeedStrategy`
selectable under ``trainer.strategy`` by class path (with ``init_args``) or by its registered name
``multi_deepspeed``. Class paths resolve from the current directory too, as with ``python -m``, so
``examples.gan.DigitsGAN`` works from the repository root.

``--ckpt_path last`` finds the newest ``last.ckpt`` of the logger's earlier versions (each run logs into a
new ``version_N`` folder, so Lightning alone would look only in the new, empty one). An error stops every
rank; each has logged it in one line, and rank 0 ends with where it came from, and with its traceback only for
an error a traceback helps to find (a bug, not a setting, a path or the data), or with
``LIGHTNING_MULTIDS_TRACEBACK=1``.

``lightning-multids export CKPT OUT [--dtype bf16] [--format hf [--merge-lora] | lightning] [--unsafe-load]`` writes
one plain ``state_dict`` per engine, a ``save_pretrained`` folder per engine holding a Hugging Face model, or one
file that ``Model.load_from_checkpoint`` loads. It loads tensors
and plain types only unless ``--unsafe-load`` says the checkpoint is trusted, as ``fit --weights_only false`` does.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

import lightning_multids  # noqa: F401  (registers the strategy name `multi_deepspeed`)
from lightning_multids._noise import quiet
from lightning_multids.checkpoint import (
    EXPORT_FORMATS,
    LIGHTNING_EXPORT,
    LIGHTNING_FILE,
    PLAIN,
    export,
    read_lightning_part,
)
from lightning_multids.utilities.progress import LineProgress

__all__ = ["MultiDeepSpeedCLI", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DESCRIPTION = (
    "Train LightningModules with one DeepSpeed engine per submodule. Subcommands: fit, validate, test, predict "
    "(LightningCLI; start from a YAML in configs/), and `export CKPT OUT` (plain state_dicts from a checkpoint)."
)
EPILOG = (
    "Also: `export CKPT OUT` writes each engine's weights from a checkpoint directory as plain state_dicts, "
    "save_pretrained folders or one Lightning file (lightning-multids export --help)."
)


class MultiDeepSpeedCLI(LightningCLI):
    """``LightningCLI`` for any LightningModule and LightningDataModule given by class path.

    Upstream lines that tell its user nothing (Lightning's tips, torch's deprecations of what Lightning and
    DeepSpeed call) are hidden for the whole call (:func:`lightning_multids._noise.quiet`).

    The saved ``config.yaml`` of a run is overwritten when the same log directory is used again.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        with quiet():  # upstream lines that tell the user nothing, from `Trainer(...)` to the end of the subcommand
            super().__init__(
                pl.LightningModule,
                pl.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
                parser_kwargs={"description": DESCRIPTION, "epilog": EPILOG},
                args=list(args) if args is not None else None,
                run=run,
            )

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """Lightning's Trainer, its progress bar (tqdm's or rich's) as plain lines when the output is not a terminal."""
        trainer = super().instantiate_trainer(**kwargs)
        if not sys.stdout.isatty():
            trainer.callbacks = [  # type: ignore[attr-defined]
                LineProgress() if type(callback) in (TQDMProgressBar, RichProgressBar) else callback
                for callback in trainer.callbacks  # type: ignore[attr-defined]
            ]
        return trainer

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path last`` across the logger's versions (see :func:`newest_last_checkpoint`)."""
        self._resolve_last()

    def before_validate(self) -> None:
        """As :meth:`before_fit`."""
        self._resolve_last()

    def before_test(self) -> None:
        """As :meth:`before_fit`."""
        self._resolve_last()

    def before_predict(self) -> None:
        """As :meth:`before_fit`."""
        self._resolve_last()

    def _resolve_last(self) -> None:
        arguments = self.config_init[self.subcommand]
        if arguments.get("ckpt_path") != "last" or not _checkpoints_per_version(self.trainer):
            return  # Lightning's own "last": the fixed `dirpath` of a ModelCheckpoint
        logger = self.trainer.loggers[0]
        root = Path(str(logger.save_dir)) / str(logger.name)
        found = newest_last_checkpoint(root)
        start = "so this run starts from scratch" if found is None else f"resuming from {found}"
        rank_zero_info(
            f"--ckpt_path last: {'no' if found is None else 'the newest'} last checkpoint under "
            f"{root}/*/checkpoints, {start}"
        )
        if found is not None and self.subcommand == "fit":
            self._refuse_finished(found)
        arguments["ckpt_path"] = None if found is None else str(found)

    def _refuse_finished(self, found: Path) -> None:
        """Stop, before any rank starts or any folder is made, a resume whose checkpoint is past ``max_epochs``.

        Lightning would refuse it once the ranks had loaded the checkpoint, with a traceback, after the new run's
        version folder was made. A checkpoint that cannot be read here is left to the fit, which reports it.
        """
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs < 0:
            return
        try:  # a single-file checkpoint is mapped, not read: only its small entries are
            saved = (
                read_lightning_part(found, None) if found.is_dir() else torch.load(found, mmap=True, weights_only=True)
            )
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError):
            return
        start = _resumed_epoch(saved)
        if start is not None and start >= max_epochs:
            self.parser.error(
                f"--ckpt_path last resumes {found}, which goes on at epoch {start + 1}, and "
                f"--trainer.max_epochs={max_epochs} ends training before it, so nothing would train. Give "
                f"--trainer.max_epochs above {start} to train on from it, or leave out --ckpt_path to start a new run."
            )


def _resumed_epoch(saved: dict[str, Any]) -> int | None:
    """The epoch (from 0) a fit resumed from Lightning's checkpoint ``saved`` starts in; None where not recorded.

    A checkpoint saved at the end of epoch ``e`` records ``epoch`` ``e`` and that ``e + 1`` epochs were processed, and
    resumes at ``e + 1``; one saved during epoch ``e`` resumes in it.
    """
    progress = saved.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    processed = progress.get("processed")
    if isinstance(processed, int):
        return processed
    epoch = saved.get("epoch")
    return epoch if isinstance(epoch, int) else None


_LAST = re.compile(
    rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-v?\d+)?(\.old)?{re.escape(ModelCheckpoint.FILE_EXTENSION)}$"
)  # `.old`: the last checkpoint kept while a save replaced it (checkpoint.old_path), if that save died


def _checkpoints_per_version(trainer: pl.Trainer) -> bool:
    """Whether the trainer saves checkpoints into each logger version's folder (no ``dirpath`` of its own)."""
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    return bool(trainer.loggers) and bool(callbacks) and all(c.dirpath is None for c in callbacks)


def newest_last_checkpoint(root: Path) -> Path | None:
    """The most recently written complete ``last.ckpt`` (or ``last-vN.ckpt``) in ``root/*/checkpoints``.

    A directory with its Lightning part, or a single file (``checkpoint_format="file"``, written under another name
    and renamed when complete).

    ``root`` is a logger's ``save_dir/name``; its subfolders are the runs' versions. As Lightning's own
    ``ckpt_path="last"``, the newest by modification time wins.
    """
    found = [
        path
        for path in root.glob("*/checkpoints/*")
        if _LAST.match(path.name) and (path.is_file() or (path / LIGHTNING_FILE).is_file())  # checkpoint_format
    ]
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def export_main(argv: Sequence[str]) -> None:
    """Run ``export CKPT OUT [--dtype bf16] [--format hf [--merge-lora]] [--unsafe-load]``: one output per engine."""
    parser = argparse.ArgumentParser(
        prog="lightning-multids export",
        description="Write one consolidated state_dict per submodule from a checkpoint.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint saved by MultiDeepSpeedStrategy: a directory, or one file (checkpoint_format)"
    )
    parser.add_argument("out", help="the directory to write NAME.pt files into")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="the dtype of the weights written (default fp32)"
    )
    parser.add_argument(
        "--format",
        choices=list(EXPORT_FORMATS),
        default="pt",
        help="pt: NAME.pt state dicts (default); hf: a save_pretrained folder NAME/ per Hugging Face engine; "
        "lightning: one file, model.ckpt, for Model.load_from_checkpoint",
    )
    parser.add_argument(
        "--merge-lora", action="store_true", help="with --format hf: merge PEFT adapters into their base model"
    )
    parser.add_argument(
        "--unsafe-load",
        action="store_true",
        help="load every object the checkpoint holds (torch.load with weights_only=False), not only tensors and "
        "plain types, and import the model class it names: only for a checkpoint you trust",
    )
    args = parser.parse_args(list(argv))
    if args.merge_lora and args.format != "hf":
        parser.error("--merge-lora needs --format hf")
    try:
        paths = export(
            args.checkpoint,
            args.out,
            dtype=DTYPES[args.dtype],
            format=args.format,
            merge_lora=args.merge_lora,
            weights_only=False if args.unsafe_load else None,
        )
    except (ValueError, OSError, pickle.UnpicklingError) as error:  # the message says which path, and what to do
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for path in paths:
        print(f"{path}  {_loading_line(path)}")


def _loading_line(path: Path) -> str:
    """What an exported file or folder holds, and the line that loads it."""
    if path.name == LIGHTNING_EXPORT:
        return f'the whole LightningModule, without optimizer state: Model.load_from_checkpoint("{path}")'
    if path.is_dir():
        return (
            f'a save_pretrained folder: AutoModel...from_pretrained("{path}"), or for an adapter '
            f'PeftModel.from_pretrained(base, "{path}")'
        )
    if path.stem == PLAIN:
        return (
            "the entries of submodules without an engine, keyed as in the LightningModule: "
            f'model.load_state_dict(torch.load("{path}"), strict=False)'
        )
    return f'the state_dict of submodule {path.stem}: model.{path.stem}.load_state_dict(torch.load("{path}"))'


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning-multids``: ``export`` here, every other subcommand to :class:`MultiDeepSpeedCLI`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["export"]:
        export_main(args[1:])
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        MultiDeepSpeedCLI(None if argv is None else args)  # None: LightningCLI reads sys.argv itself
    except Exception as error:
        if rank_zero_only.rank != 0:  # type: ignore[attr-defined]
            sys.exit(1)  # the strategy logged this rank's error in one line (`on_exception`); rank 0 shows it
        shown = _shown_error(error)  # LightningCLI wraps an error of the module's `__init__` in its own
        if getattr(shown, "lightning_multids_peer_failed", False):  # a collective failed: another rank stopped
            sys.exit("lightning-multids: stopped because another rank failed; its line above says why")
        if os.environ.get(TRACEBACK) == "1" or not _misuse(shown):
            raise
        where = f"{_where(shown)}; {TRACEBACK}=1 shows the traceback"
        if getattr(shown, "lightning_multids_logged", False):  # the strategy's line above says what it was
            sys.exit(f"lightning-multids: stopped by the error above ({where})")
        sys.exit(f"lightning-multids: {type(shown).__name__}: {shown}\n  ({where})")


TRACEBACK = "LIGHTNING_MULTIDS_TRACEBACK"
"""Set to 1, the command shows the traceback of every error, not only of those it takes for a bug."""

_MISUSE = (ValueError, OSError, FloatingPointError, MisconfigurationException)
"""What a setting, a path or the data causes: shown as the message and where it came from, not as a traceback."""

_PACKAGE = Path(__file__).resolve().parent


def _shown_error(error: BaseException) -> BaseException:
    """The error to show: the innermost of the chain raised by the package or by the user's code, else ``error``.

    (LightningCLI and jsonargparse raise their own errors from the one the module's ``__init__`` raised.)
    """
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and not any(link is seen for seen in chain):  # a chain may loop back
        chain.append(link)
        link = link.__cause__ or link.__context__
    ours = [link for link in chain if _raised_deliberately(link) or _raised_by_the_user(link)]
    return ours[-1] if ours else error


def _raised_by_the_user(error: BaseException) -> bool:
    """Whether ``error`` came through the user's code (a module's ``__init__``, not only the parser's code)."""
    return bool(_user_frames(error))


def _frames(error: BaseException) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(error.__traceback__))


def _user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``error``'s traceback in the user's code: outside the package, installed packages and scripts."""
    paths = sysconfig.get_paths()
    outside = [_PACKAGE, *(Path(paths[key]).resolve() for key in ("purelib", "platlib", "stdlib", "scripts"))]
    return [
        frame
        for frame in _frames(error)
        if not frame.filename.startswith("<")  # `<frozen runpy>`, `<string>`
        and not any(Path(frame.filename).resolve().is_relative_to(path) for path in outside)
    ]


def _raised_deliberately(error: BaseException) -> bool:
    """Whether a ``raise`` statement of the package raised ``error``: one of its errors, which name the fix."""
    frames = _frames(error)
    if not frames or isinstance(error, AssertionError):
        return False
    last = frames[-1]
    return Path(last.filename).resolve().is_relative_to(_PACKAGE) and (last.line or "").lstrip().startswith("raise")


def _misuse(error: BaseException) -> bool:
    """Whether ``error`` is one a user causes (its message says what to do), or one a traceback helps to find.

    The strategy's own errors (a ``raise`` of the package) name the engine, the setting and the fix; elsewhere
    the types of :data:`_MISUSE`. A bug in the package (an ``AttributeError`` in its code) keeps its traceback.
    """
    return _raised_deliberately(error) or isinstance(error, _MISUSE)


def _where(error: BaseException) -> str:
    """The innermost line of the user's code the error came through, else where it was raised."""
    frames = _user_frames(error) or _frames(error)
    if not frames:
        return "raised at an unknown place"
    return f"in {_shown(frames[-1].filename)}:{frames[-1].lineno}, {frames[-1].name}"


def _shown(filename: str) -> str:
    path = Path(filename).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


if __name__ == "__main__":
    main()
