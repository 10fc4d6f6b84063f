"""The cost of a gradient hook per parameter per backward: the strategy's, a bare one, torch's multi-grad hook.

One process, no GPU, no DeepSpeed collective: a backward through ``--params`` parameters of 2 × 2 (``(p * p).sum()``
each), without a hook and with each kind of hook: ``--rounds`` rounds, each timing ``--backwards`` backwards of
every kind in a rotating order (the machine's drift falls on all alike), and the median round of each kind. The
strategy's hook runs inside ``Router.routed`` on one engine whose DeepSpeed prologue and epilogue
are stubbed out, so that only the strategy's own Python is timed. Cost per parameter = (hooked − its base) / params,
the base being the same backward without the hook (plain, or routed with no parameter hooked)::

    python benchmarks/hooks.py --params 300
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from lightning_multids import _routing as routing
from lightning_multids._compat import deepspeed as ds_compat


def attach_nothing() -> Callable[[], None]:
    return lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--backwards", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in ("enter_backward", "end_backward", "leave_backward"):  # DeepSpeed's side, not timed here
        setattr(ds_compat, name, lambda *_, **__: None)
    module = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(2, 2)) for _ in range(args.params)])
    params = list(module)
    engine: Any = SimpleNamespace(module=module, zero_optimization_stage=lambda: 0, inside_no_sync_ctxt=False)
    router = routing.Router()

    def plain() -> None:
        sum((p * p).sum() for p in params).backward()  # type: ignore[union-attr]

    def routed() -> None:
        loss = sum((p * p).sum() for p in params)
        with router.routed(loss, {"engine": engine}):  # type: ignore[arg-type]
            loss.backward()  # type: ignore[union-attr]

    def bare() -> Callable[[], None]:
        handles = [p.register_hook(lambda grad: None) for p in params]
        return lambda: [handle.remove() for handle in handles] and None

    def multi() -> Callable[[], None]:
        return torch.autograd.graph.register_multi_grad_hook(params, lambda grad: None, mode="any").remove

    def strategy() -> Callable[[], None]:
        handles = router.watch("engine", engine)
        return lambda: [handle.remove() for handle in handles] and None

    # (label, backward, attach -> detach, the label of its base)
    kinds = [
        ("plain", plain, attach_nothing, ""),
        ("inside `Router.routed`, no parameter hooked", routed, attach_nothing, ""),
        ("a tensor hook that does nothing", plain, bare, "plain"),
        ('torch\'s `register_multi_grad_hook(mode="any")`', plain, multi, "plain"),
        (
            "the strategy's hook (inside `Router.routed`)",
            routed,
            strategy,
            "inside `Router.routed`, no parameter hooked",
        ),
    ]
    times: dict[str, list[float]] = {label: [] for label, *_ in kinds}
    for round_ in range(args.rounds):  # the kinds alternate within each round, in a rotating order
        for label, backward, attach, _ in kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]:
            detach = attach()
            for _ in range(5):
                backward()
            start = time.perf_counter()
            for _ in range(args.backwards):
                backward()
            times[label].append((time.perf_counter() - start) / args.backwards * 1e3)
            detach()
    median = {label: statistics.median(values) for label, values in times.items()}
    print(f"| backward ({args.params} parameters) | ms, median of {args.rounds} rounds | µs per parameter over base |")
    print("|---|---|---|")
    for label, _, _, base in kinds:
        extra = f"{(median[label] - median[base]) / args.params * 1e3:.2f}" if base else ""
        print(f"| {label} | {median[label]:.3f} | {extra} |")


if __name__ == "__main__":
    main()
