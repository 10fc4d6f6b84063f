"""What the package sets up around DeepSpeed: at import, only while DeepSpeed is imported; the rest while engines live.

- DeepSpeed warns on import, on every machine without a GPU, that it set its accelerator to the CPU because
  it found no GPU. The strategy sets DeepSpeed's accelerator from the Trainer's anyway
  (:mod:`lightning_multids._accelerator`), so that one message is dropped while ``import lightning_multids`` imports
  DeepSpeed (the filter is removed after it: the import leaves no global state behind).

From the strategy's process-group start (``setup_distributed``) to its ``teardown``:

- DeepSpeed JIT-builds some ops with torch's C++ extension builder when first used (its own optimizers: a
  config's ``optimizer`` section, ``DeepSpeedCPUAdam`` for offloaded states). torch keeps such builds in
  ``~/.cache/torch_extensions/py311_cpu/``, a folder shared by every environment of that Python, whatever its
  torch or DeepSpeed: two virtual environments rebuild an op over each other (30-70 s each time). Unless
  ``TORCH_EXTENSIONS_DIR`` is set, it is set to a folder inside the running environment (``sys.prefix``), so each
  environment builds once and keeps its build; teardown unsets it.
- From ``setup``: torch 2.13 and 2.14 deprecate ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which
  DeepSpeed 0.19.8's ZeRO calls at every gather and reduction (torch 2.15 no longer does). Python's "once per
  place" does not hold during a fit (the registry that remembers a warning is cleared whenever the warning filters
  change), so a ZeRO-3 engine printed them at every step, over a thousand lines per run, about a call the user did
  not write and cannot change. Those two messages are not shown then; the filter is installed only where torch
  marks the functions deprecated, and removed at teardown.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import cast

import torch.distributed

EXTENSIONS_VARIABLE = "TORCH_EXTENSIONS_DIR"
DEEPSPEED_LOGGER = "DeepSpeed"
ACCELERATOR_GUESS = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
"""DeepSpeed 0.19.8's warning when it finds no GPU (``deepspeed/accelerator/real_accelerator.py``)."""


ZERO_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
"""The torch 2.13 deprecations that DeepSpeed 0.19.8's ZeRO collectives trigger (``torch/distributed``)."""


ZERO_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


def hide_zero_deprecations() -> Callable[[], None]:
    """Stop showing the FutureWarnings of :data:`ZERO_DEPRECATIONS` (DeepSpeed's calls, not the user's).

    Returns what shows them again. Nothing is hidden where torch does not deprecate the functions (it marks them
    with ``__deprecated__``, PEP 702): there is nothing to hide, and a filter would be a needless side effect.
    """
    if not any(hasattr(getattr(torch.distributed, name, None), "__deprecated__") for name in ZERO_COLLECTIVES):
        return _nothing
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=ZERO_DEPRECATIONS, category=FutureWarning)
    added = warnings.filters[0]
    if added in before:  # the same filter was there (the user's, or an outer fit's): it stays theirs to remove
        return _nothing

    def show_again() -> None:
        with suppress(ValueError):  # already gone, e.g. the user reset the filters
            cast(list, warnings.filters).remove(added)  # a list at run time; typeshed says Sequence

    return show_again


def _nothing() -> None:
    pass


def default_extensions_dir() -> Path:
    """Where torch builds C++ extensions for this environment when ``TORCH_EXTENSIONS_DIR`` is unset."""
    return Path(sys.prefix) / "torch_extensions"


def keep_extensions_in_environment() -> Callable[[], None]:
    """Set ``TORCH_EXTENSIONS_DIR`` to :func:`default_extensions_dir` unless it is set already; return what undoes it.

    The undo unsets the variable only if it still holds the value set here (a value set since is someone else's).
    """
    if EXTENSIONS_VARIABLE in os.environ:
        return _nothing
    value = os.environ[EXTENSIONS_VARIABLE] = str(default_extensions_dir())

    def unset() -> None:
        if os.environ.get(EXTENSIONS_VARIABLE) == value:
            del os.environ[EXTENSIONS_VARIABLE]

    return unset


class _DropAcceleratorGuess(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != ACCELERATOR_GUESS


@contextmanager
def quiet_accelerator_guess() -> Iterator[None]:
    """Drop DeepSpeed's no-GPU accelerator warning inside the block (the filter is removed after it)."""
    logger, drop = logging.getLogger(DEEPSPEED_LOGGER), _DropAcceleratorGuess()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
