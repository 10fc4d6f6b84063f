"""The parameter guard's two ways to step aside while DeepSpeed runs, timed against each other in one process.

``ParameterGuard`` swaps each parameter's class back to its own around every backward and step (``swap``, the
library's), so that DeepSpeed's accesses to ``grad`` and ``data`` cost what they cost without the guard. The other
way (``keep``) keeps the guarded class while any check is enabled and only empties the set of active checks, so a
backward or step costs no swap but each access goes through a Python property. The ``gan`` case of ``overhead.py``
(transformer, ``--size tiny``, fp32, one process, no GPU) runs under each in alternating order; the median step
time of each round, and the median of the rounds, are printed::

    cd benchmarks && torchrun --nproc-per-node 1 guard_swaps.py --stage 3
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from typing import Any

import torch
from common import release_memory
from overhead import Run, batches, configure, run_strategy

from lightning_multids._compat import torch as torch_compat

SWAP = torch_compat.ParameterGuard._update


def keep(self: Any) -> None:
    """``ParameterGuard._update`` with classes swapped on enable/disable only, not around a suspension."""
    self._active.clear()
    self._active.update(a for a in self._enabled if self._suspended[a] <= 0)
    want = bool(self._enabled)
    if want != self._swapped:
        self._swapped = want
        for param, original, guarded in self._pairs:
            param.__class__ = guarded if want else original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    parser.add_argument("--case", default="gan")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    configure(argparse.Namespace(size="tiny", device="cpu", arch="transformer"))
    run = Run(args.case, args.stage, "cpu", "32-true")
    ways = {"swap": SWAP, "keep": keep}
    medians: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(args.rounds):
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
        for name in order:
            torch_compat.ParameterGuard._update = ways[name]  # type: ignore[method-assign]
            data = batches(1000 * round_, 10 + args.steps, torch.device("cpu"))
            medians[name].append(1e3 * statistics.median(run_strategy(run, data, 10)))
            release_memory()
    torch_compat.ParameterGuard._update = SWAP  # type: ignore[method-assign]
    for name, values in medians.items():
        print(f"{args.case} ZeRO-{args.stage} {name}: {statistics.median(values):.2f} ms per step (rounds: "
              f"{', '.join(f'{v:.2f}' for v in values)})")  # fmt: skip


if __name__ == "__main__":
    main()
