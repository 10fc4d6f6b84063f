"""The fixed cost of a 2-rank test launch: ranks started as new interpreters against ranks forked from the fork server.

The test harness (``tests/distributed/harness.py``) forks each launch's ranks from a server that has imported torch,
Lightning and DeepSpeed once; ``fresh=True`` starts new interpreters, as every launch did before. Each round times one
launch of each kind, in alternating order (the machine's drift falls on both alike); the report gives each kind's
median with its range, and the ratio of the medians. Two launches: ``noop``, a function that returns its argument
(the start-up alone), and ``fit``, one step of the GAN pattern at ZeRO-2 (a process group, two DeepSpeed engines).
Run from the repository's root, in its venv (``make bench-launch``)::

    PYTHONPATH=. python benchmarks/launch.py --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from tests.distributed.harness import on_ranks
from tests.distributed.test_harness import rank_and_argument
from tests.distributed.test_patterns import fit_patterns

LAUNCHES: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "noop": (rank_and_argument, (21,)),
    "fit": (fit_patterns, (2, "sgd", 1, "32-true", ["gan"])),
}


def timed(function: Callable[..., Any], args: tuple[Any, ...], fresh: bool) -> float:
    start = time.perf_counter()
    on_ranks(function, *args, fresh=fresh, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--launch", choices=sorted(LAUNCHES), nargs="+", default=sorted(LAUNCHES))
    args = parser.parse_args()
    on_ranks(rank_and_argument, 0)  # starts the fork server, and builds DeepSpeed's op if it is not built yet
    report = {}
    for name in args.launch:
        function, function_args = LAUNCHES[name]
        times: dict[str, list[float]] = {"fresh": [], "forked": []}
        for round_ in range(args.rounds):
            order = ["fresh", "forked"] if round_ % 2 == 0 else ["forked", "fresh"]
            for kind in order:
                times[kind].append(timed(function, function_args, fresh=kind == "fresh"))
        medians = {kind: statistics.median(values) for kind, values in times.items()}
        report[name] = {
            kind: {"median_s": round(medians[kind], 2), "range_s": [round(min(v), 2), round(max(v), 2)]}
            for kind, v in times.items()
        }
        report[name]["fresh_over_forked"] = round(medians["fresh"] / medians["forked"], 1)
        print(name, json.dumps(report[name]), flush=True)


if __name__ == "__main__":
    main()
