"""DeepSpeed's accelerator follows Lightning's.

DeepSpeed picks its accelerator by itself when it is first imported: ``DS_ACCELERATOR`` if set, else CUDA
whenever a GPU is visible. ``Trainer(accelerator="cpu")`` on a GPU machine would then put the module on
the CPU and DeepSpeed's engines, buffers and ``set_device`` on CUDA (rank 1 of two on a one-GPU machine
dies with "invalid device ordinal"). The strategy tells DeepSpeed which accelerator to use, through
DeepSpeed's public ``set_accelerator``, before the process group and the engines exist.
"""

from __future__ import annotations

import os

from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

SUPPORTED = ("cpu", "cuda")
"""The device types the strategy runs on; DeepSpeed's accelerators of the same names."""


def choose(device_type: str, ds_accelerator_env: str | None) -> str:
    """The DeepSpeed accelerator for Lightning's ``device_type``; a ValueError where the two cannot agree.

    Args:
        device_type: the type of the strategy's root device (``"cpu"``, ``"cuda"``, ...).
        ds_accelerator_env: the ``DS_ACCELERATOR`` environment variable, or None when unset.
    """
    if device_type not in SUPPORTED:
        raise ValueError(
            f"MultiDeepSpeedStrategy runs on CPU or CUDA devices, and the Trainer's accelerator gives "
            f"{device_type!r} devices. Use `Trainer(accelerator='cpu')` or `Trainer(accelerator='gpu')` on CUDA."
        )
    if ds_accelerator_env is not None and ds_accelerator_env != device_type:
        raise ValueError(
            f"The environment sets DS_ACCELERATOR={ds_accelerator_env}, but the Trainer puts the module on "
            f"{device_type!r} devices, and DeepSpeed's engines must run on the same devices. Unset "
            "DS_ACCELERATOR (the strategy chooses DeepSpeed's accelerator from the Trainer's) or set it to "
            f"{device_type!r}, or choose the Trainer's accelerator to match it."
        )
    return device_type


def follow(device_type: str) -> None:
    """Make DeepSpeed use the accelerator for ``device_type`` from now on.

    It is not switched back at teardown: the engines built under it (and what users do with them after
    ``fit``, such as gathering ZeRO-3 partitions) go on using it, as Lightning's accelerator stays too.
    """
    name = choose(device_type, os.environ.get("DS_ACCELERATOR"))
    if get_accelerator().device_name() != name:
        set_accelerator(_make(name))


def _make(name: str) -> DeepSpeedAccelerator:
    if name == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        return CPU_Accelerator()
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    return CUDA_Accelerator()
