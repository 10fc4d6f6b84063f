"""The ``lightning-multids`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from lightning_multids.checkpoint import export

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``lightning-multids export CKPT OUT [--dtype bf16]``: one ``state_dict`` per engine in ``OUT``."""
    parser = argparse.ArgumentParser(prog="lightning-multids")
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser(
        "export", help="write one consolidated fp32 state_dict per submodule from a checkpoint directory"
    )
    export_parser.add_argument("checkpoint", help="a checkpoint directory saved by MultiDeepSpeedStrategy")
    export_parser.add_argument("out", help="the directory to write NAME.pt files into")
    export_parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="the dtype of the weights written (default fp32)"
    )
    args = parser.parse_args(argv)
    for path in export(args.checkpoint, args.out, dtype=DTYPES[args.dtype]):
        print(path)


if __name__ == "__main__":
    main()
