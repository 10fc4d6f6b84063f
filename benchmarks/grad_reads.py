"""What the guard on ``param.grad`` and ``param.data`` adds per training step: class swaps and guarded accesses.

While an engine holds gradients between a backward and its step (and, at ZeRO-3, outside its forward), its
parameters' class is a subclass whose ``grad`` (and ``data``) is a Python property (``ParameterGuard``); the strategy
swaps the classes back before it calls DeepSpeed. So a step pays for the swaps (one per parameter each way) and for
whatever reads those attributes while the guard is on.
Both are counted per training step on the ``gan`` and ``single`` cases of ``overhead.py`` (transformer,
``--size tiny``, one process, no GPU) at each stage, then timed: ``--params`` parameters swapped there and back, and
read plain and guarded, ``--repeats`` times per round over ``--rounds`` rounds in a rotating order, the median
round of each. Added host time per step = swaps × a swap + guarded accesses × (guarded − plain read)::

    cd benchmarks && torchrun --nproc-per-node 1 grad_reads.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import overhead
import torch

from lightning_multids._compat import torch as torch_compat


class _Counting:
    """A descriptor of the tensor base class as the guard's properties use it, with reads and writes counted."""

    def __init__(self, descriptor: Any) -> None:
        self.descriptor, self.reads = descriptor, 0

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        self.reads += 1
        return self.descriptor.__get__(obj, owner)

    def __set__(self, obj: Any, value: Any) -> None:
        self.reads += 1
        self.descriptor.__set__(obj, value)

    def __delete__(self, obj: Any) -> None:
        self.descriptor.__delete__(obj)


def counts_per_step(case: str, stage: int, steps: int) -> tuple[float, float]:
    """Class swaps and guarded accesses (``grad`` and ``data``), per parameter, per training step.

    Two fits, of 1 and of ``steps + 1`` steps: the difference is ``steps`` steps, without setup and teardown.
    """
    descriptors = dict(torch_compat._TENSOR_ATTRIBUTES)
    counters = {name: _Counting(descriptor) for name, descriptor in descriptors.items()}
    swaps = [0]
    update = torch_compat.ParameterGuard._update

    def counted(self: Any) -> None:
        swapped = self._swapped
        update(self)
        swaps[0] += len(self._pairs) * (self._swapped != swapped)

    run = overhead.Run(case, stage, "cpu", "32-true")
    data = overhead.batches(0, steps + 1, torch.device("cpu"))
    torch_compat._TENSOR_ATTRIBUTES.update(counters)
    torch_compat.ParameterGuard._update = counted  # type: ignore[method-assign]
    try:
        overhead.run_strategy(run, data[:1], warmup=0)
        first = (swaps[0], sum(c.reads for c in counters.values()))
        overhead.run_strategy(run, data, warmup=0)
    finally:
        torch_compat._TENSOR_ATTRIBUTES.update(descriptors)
        torch_compat.ParameterGuard._update = update  # type: ignore[method-assign]
    reads = sum(c.reads for c in counters.values())
    return (swaps[0] - 2 * first[0]) / steps, (reads - 2 * first[1]) / steps


def costs(params: int, repeats: int, rounds: int) -> dict[str, float]:
    """Nanoseconds per parameter: a class swap (one way), a plain read and a guarded read by DeepSpeed."""
    plain = [torch.nn.Parameter(torch.zeros(2)) for _ in range(params)]
    guarded = [torch.nn.Parameter(torch.zeros(2)) for _ in range(params)]
    passes = {"grad": lambda param, reader, verb: None}
    guard = torch_compat.ParameterGuard(guarded, passes)
    swapped = torch_compat.ParameterGuard([torch.nn.Parameter(torch.zeros(2)) for _ in range(params)], passes)
    namespace: dict[str, Any] = {"__name__": "deepspeed.bench"}  # the reader the check sees: a module of DeepSpeed's
    exec("def read(params, n):\n    for _ in range(n):\n        for p in params:\n            p.grad\n", namespace)

    def swap(n: int) -> None:
        for _ in range(n):
            swapped.enable("grad")
            swapped.disable("grad")

    kinds: dict[str, tuple[Callable[[int], None], int]] = {
        "plain read": (lambda n: namespace["read"](plain, n), 1),
        "guarded read": (lambda n: namespace["read"](guarded, n), 1),
        "swap": (swap, 2),
    }
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    guard.enable("grad")
    try:
        for index in range(rounds):
            names = list(kinds)
            for kind in names[index % len(names) :] + names[: index % len(names)]:
                function, per_repeat = kinds[kind]
                start = time.perf_counter()
                function(repeats)
                times[kind].append((time.perf_counter() - start) / (repeats * params * per_repeat) * 1e9)
    finally:
        guard.close()
    return {kind: statistics.median(values) for kind, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--params", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="outputs/bench/grad_reads.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    overhead.configure(argparse.Namespace(size="tiny", device="cpu", arch="transformer"))
    ns = costs(args.params, args.repeats, args.rounds)
    counts = {
        f"{case} ZeRO-{stage}": counts_per_step(case, stage, args.steps)
        for case in ("gan", "single")
        for stage in range(4)
    }
    print("ns per parameter: " + ", ".join(f"{kind} {value:.0f}" for kind, value in ns.items()))
    print("| case | class swaps | guarded accesses | added µs per step |\n|---|---|---|---|")
    for key, (swaps, reads) in counts.items():
        added = (swaps * ns["swap"] + reads * (ns["guarded read"] - ns["plain read"])) / 1e3
        print(f"| {key} | {swaps:.0f} | {reads:.0f} | {added:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "ns": ns, "per_step": counts}, indent=2))


if __name__ == "__main__":
    main()
