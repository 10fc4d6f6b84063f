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
  environment builds once and keeps its build; where that prefix is read-only (a shared cluster environment, a
  container image), torch's own per-user default is left as it is. Teardown unsets it.
- DeepSpeed reads ``LOCAL_RANK`` (and its launcher's ``RANK``/``WORLD_SIZE``) from the environment in every engine
  it builds and in ``zero.Init``, and stops with an ``AssertionError`` where it is unset. Lightning's launcher and
  ``torchrun`` set it; ``srun`` (SLURM), ``jsrun`` (LSF), Kubeflow and MPI do not, and Lightning's cluster
  environments read their own variables instead. The three are set from Lightning's cluster environment
  (:func:`set_launch_variables`, as Lightning's ``DeepSpeedStrategy`` does); teardown puts back what was there.
- From ``setup``: the upstream warnings that say nothing to the user of the strategy are hidden
  (:func:`lightning_multids._noise.hide_upstream_warnings`), and shown again at teardown.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

EXTENSIONS_VARIABLE = "TORCH_EXTENSIONS_DIR"
DEEPSPEED_LOGGER = "DeepSpeed"
ACCELERATOR_GUESS = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
"""DeepSpeed 0.19.8's warning when it finds no GPU (``deepspeed/accelerator/real_accelerator.py``)."""


def _nothing() -> None:
    pass


def default_extensions_dir() -> Path:
    """Where torch builds C++ extensions for this environment when ``TORCH_EXTENSIONS_DIR`` is unset."""
    return Path(sys.prefix) / "torch_extensions"


def keep_extensions_in_environment() -> Callable[[], None]:
    """Set ``TORCH_EXTENSIONS_DIR`` to :func:`default_extensions_dir` unless it is set already; return what undoes it.

    Left unset where the environment's prefix is not writable (torch then builds in its per-user folder).
    The undo unsets the variable only if it still holds the value set here (a value set since is someone else's).
    """
    folder = default_extensions_dir()
    if EXTENSIONS_VARIABLE in os.environ or not _writable(folder):
        return _nothing
    return set_variables({EXTENSIONS_VARIABLE: str(folder)})


def _writable(folder: Path) -> bool:
    """Whether ``folder`` exists and is writable, or could be made in its nearest existing parent."""
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    return existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""What DeepSpeed reads of a launcher's environment (``deepspeed.initialize``, ``zero.Init``)."""


def set_launch_variables(*, rank: int, world_size: int, local_rank: int) -> Callable[[], None]:
    """Set :data:`LAUNCH_VARIABLES` to Lightning's ranks (from its cluster environment); return what undoes it."""
    return set_variables(dict(zip(LAUNCH_VARIABLES, map(str, (rank, world_size, local_rank)), strict=True)))


def set_variables(values: dict[str, str]) -> Callable[[], None]:
    """Set environment variables; return what puts back each one set here that still holds the value set here."""
    before = {key: os.environ.get(key) for key, value in values.items() if os.environ.get(key) != value}
    os.environ.update({key: values[key] for key in before})

    def undo() -> None:
        for key, old in before.items():
            if os.environ.get(key) != values[key]:
                continue  # changed since: someone else's now
            if old is None:
                del os.environ[key]
            else:
                os.environ[key] = old

    return undo


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
