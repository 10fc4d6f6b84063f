"""The ``lightning-multids`` command: Lightning's CLI (``fit``, ``validate``, ``test``, ``predict``) plus ``export``.

``lightning-multids fit --config configs/gan.yaml`` is ``LightningCLI`` with any LightningModule and
LightningDataModule given by ``class_path`` in the YAML, and :class:`~lightning_multids.MultiDeepSpeedStrategy`
selectable under ``trainer.strategy`` by class path (with ``init_args``) or by its registered name
``multi_deepspeed``. Class paths resolve from the current directory too, as with ``python -m``, so
``examples.gan.DigitsGAN`` works from the repository root.

``lightning-multids export CKPT OUT [--dtype bf16]`` writes one plain ``state_dict`` per engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_multids  # noqa: F401  (registers the strategy name `multi_deepspeed`)
from lightning_multids.checkpoint import export

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DESCRIPTION = (
    "Train LightningModules with one DeepSpeed engine per submodule. Subcommands: fit, validate, test, predict "
    "(LightningCLI; start from a YAML in configs/), and `export CKPT OUT` (plain state_dicts from a checkpoint)."
)


class MultiDeepSpeedCLI(LightningCLI):
    """``LightningCLI`` for any LightningModule and LightningDataModule given by class path.

    The saved ``config.yaml`` of a run is overwritten when the same log directory is used again.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": DESCRIPTION},
            args=list(args) if args is not None else None,
            run=run,
        )


def export_main(argv: Sequence[str]) -> None:
    """Run ``export CKPT OUT [--dtype bf16]``: one ``state_dict`` per engine in ``OUT``, then print the paths."""
    parser = argparse.ArgumentParser(
        prog="lightning-multids export",
        description="Write one consolidated state_dict per submodule from a checkpoint directory.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory saved by MultiDeepSpeedStrategy")
    parser.add_argument("out", help="the directory to write NAME.pt files into")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="the dtype of the weights written (default fp32)"
    )
    args = parser.parse_args(list(argv))
    for path in export(args.checkpoint, args.out, dtype=DTYPES[args.dtype]):
        print(path)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning-multids``: ``export`` here, every other subcommand to :class:`MultiDeepSpeedCLI`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["export"]:
        export_main(args[1:])
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    MultiDeepSpeedCLI(args)


if __name__ == "__main__":
    main()
