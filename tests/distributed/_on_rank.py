"""One rank of :func:`tests.distributed.harness.on_ranks`: call a test module's function, save its result.

Usage: _on_rank.py MODULE:FUNCTION ARGS OUT. ``ARGS`` is a ``torch.save``-d tuple of arguments; the result goes to
``OUT.<rank>``. The process then ends as every runner does (:func:`tests.distributed.common.finish`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import torch

from tests.distributed.common import finish

warnings.filterwarnings("ignore")


def main() -> None:
    target, args_path, out = sys.argv[1:4]
    module_name, _, function_name = target.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(*torch.load(args_path, weights_only=False))
    torch.save(result, f"{out}.{os.environ['TEST_RANK']}")


if __name__ == "__main__":
    main()
    finish()
