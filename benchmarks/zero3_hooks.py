"""What the strategy's ZeRO-3 forward hooks add to a ZeRO-3 engine's training step, with and without them.

At ZeRO-3 the strategy puts two forward hooks on every submodule of the engine and swaps the class of every
``_parameters`` (``_compat.deepspeed.discover_external_parameters``): a pre-hook and a post-hook per submodule call,
a pass setting DeepSpeed's ``_in_forward`` flag on every submodule at the start and the end of the outermost call,
and a Python ``__getitem__`` on each attribute read of a parameter. This script builds one ZeRO-3 engine over an MLP
of ``--layers`` ``Linear`` + ``Tanh`` blocks with ``deepspeed.initialize`` (fp32, Adam, every weight partitioned),
and times its step (a forward of the module, ``engine.backward``, ``engine.step``) in rounds that alternate the
hooks on (``hooks``) and off (``bare``), in a rotating order; each round's figure is its fastest step, the least
disturbed on a shared machine. Printed: each side's median over the rounds, the median per-round difference with
its range, and that difference per submodule call::

    torchrun --nproc-per-node 1 benchmarks/zero3_hooks.py --layers 24
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import deepspeed
import torch
from torch import nn

from lightning_multids._blocks import refuse_partitioned_use
from lightning_multids._compat.deepspeed import discover_external_parameters


def build(layers: int, width: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    blocks = [module for _ in range(layers) for module in (nn.Linear(width, width), nn.Tanh())]
    model = nn.Sequential(*blocks)
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def step(engine: deepspeed.DeepSpeedEngine, batch: torch.Tensor) -> None:
    engine.backward(engine.module(batch).pow(2).mean())
    engine.step()


def timed(engine: deepspeed.DeepSpeedEngine, batch: torch.Tensor, steps: int) -> float:
    """The fastest of ``steps`` steps, in ms: on a shared machine the least disturbed one."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(engine, batch)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(args.layers, args.width)
    batch = torch.randn(16, args.width)
    calls = len(list(engine.module.modules()))  # every submodule runs once per forward
    fastest: dict[str, list[float]] = {"hooks": [], "bare": []}
    timed(engine, batch, 10)  # warm-up
    for round_ in range(args.rounds):
        for side in ("hooks", "bare") if round_ % 2 == 0 else ("bare", "hooks"):
            handles = discover_external_parameters(engine, refuse_partitioned_use("mlp")) if side == "hooks" else []
            fastest[side].append(timed(engine, batch, args.steps))
            for handle in handles:
                handle.remove()
    differences = [a - b for a, b in zip(fastest["hooks"], fastest["bare"], strict=True)]
    middle = statistics.median(differences)
    print(f"{args.layers} blocks ({calls} submodule calls a forward), {args.rounds} rounds of {args.steps} steps")
    for side, values in fastest.items():
        print(f"{side}: {statistics.median(values):.3f} ms a step (rounds {min(values):.3f}-{max(values):.3f})")
    print(
        f"hooks - bare: {middle:.4f} ms a step ({min(differences):.4f} to {max(differences):.4f}), "
        f"{1e3 * middle / calls:.2f} us a submodule call"
    )


if __name__ == "__main__":
    main()
