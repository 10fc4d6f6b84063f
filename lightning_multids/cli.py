"""The ``lightning-multids`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_multids.checkpoint import export


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``lightning-multids export CKPT OUT``: write each engine's fp32 ``state_dict`` to ``OUT/NAME.pt``."""
    parser = argparse.ArgumentParser(prog="lightning-multids")
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser(
        "export", help="write one consolidated fp32 state_dict per submodule from a checkpoint directory"
    )
    export_parser.add_argument("checkpoint", help="a checkpoint directory saved by MultiDeepSpeedStrategy")
    export_parser.add_argument("out", help="the directory to write NAME.pt files into")
    args = parser.parse_args(argv)
    for path in export(args.checkpoint, args.out):
        print(path)


if __name__ == "__main__":
    main()
