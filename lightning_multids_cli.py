"""The ``lightning-multids`` command's entry point: its overview at once, a subcommand from ``lightning_multids.cli``.

``lightning-multids``, ``-h`` and ``--help`` print the subcommands without importing torch, Lightning or DeepSpeed,
which take seconds (``import lightning_multids`` registers the strategy with Lightning, so it imports them). A
subcommand, its ``--help`` included, runs :func:`lightning_multids.cli.main`. A module of its own, outside the
package, because importing anything inside it runs the package's ``__init__``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "fit": "train (LightningCLI's fit): start from a YAML in configs/, `fit --config configs/gan.yaml`",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "predictions over the predict data",
    "export": "each engine's weights from a checkpoint directory: NAME.pt state_dicts, save_pretrained folders "
    "or one Lightning file",
}
"""Each subcommand and what it does: LightningCLI's, then ``export``."""

LIGHTNING_SUBCOMMANDS = [name for name in SUBCOMMANDS if name != "export"]

OVERVIEW = "\n".join(
    [
        f"usage: lightning-multids [-h] [-c CONFIG] {{{','.join(LIGHTNING_SUBCOMMANDS)}}} ...",
        "       lightning-multids export CKPT OUT [--dtype ...] [--format ...]",
        "",
        "Train LightningModules with one DeepSpeed engine per submodule.",
        "",
        "subcommands (`lightning-multids SUBCOMMAND --help` lists the options of each):",
        *(f"  {name:<10}{text}" for name, text in SUBCOMMANDS.items()),
        "",
        "options:",
        "  -h, --help            show this message and exit",
        "  -c, --config CONFIG   a YAML or JSON config for fit, validate, test or predict (also after it)",
        "  --print_config        print the resolved config and exit",
        "",
    ]
)
"""What ``lightning-multids --help`` prints."""


def main(argv: Sequence[str] | None = None) -> None:
    """Print the overview for no arguments, ``-h`` or ``--help``; otherwise run :func:`lightning_multids.cli.main`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        sys.stdout.write(OVERVIEW)
        sys.exit(0)
    if not args:
        sys.stderr.write(f"{OVERVIEW}lightning-multids: error: give a subcommand\n")
        sys.exit(2)
    from lightning_multids.cli import main as run

    run(None if argv is None else args)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
