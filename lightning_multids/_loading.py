"""How a checkpoint's files are unpickled: every ``torch.load`` of one honours ``weights_only``.

``torch.load(weights_only=True)``, torch's default since 2.6, unpickles tensors, containers and primitive types
only, so a checkpoint from elsewhere cannot run code while it loads. Lightning passes the choice made in
``fit``/``validate``/``test``/``predict`` (``weights_only=None``: torch's default) to the strategy, and this
module carries it to every file of a checkpoint directory (:mod:`lightning_multids.checkpoint`):

* this package's own reads (Lightning's part, frozen and EMA weights, DeepSpeed's model states) pass it to
  ``torch.load`` (:func:`load`);
* DeepSpeed's reads (``engine.load_checkpoint``, its universal conversion, ``zero_to_fp32``) pass
  ``weights_only=False`` themselves; inside :func:`reading`, torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes
  them restricted too, with the few DeepSpeed classes that its optimizer states hold allowed
  (:func:`lightning_multids._compat.deepspeed.checkpoint_globals`, one list);
* before anything loads, :func:`reading` looks at the pickle of every ``.pt`` file in the checkpoint (not
  their tensors, nor unfinished ``*.partial`` folders) on every rank, so a refused checkpoint fails before any
  engine loads, on every rank alike, with an error naming the file.

``weights_only=False`` turns all of this off, as it does for ``torch.load`` and Lightning.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_multids._compat import deepspeed as ds_compat

FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_TRUE = ("1", "y", "yes", "true")  # as torch.load reads these variables

_inside = False  # in a restricted reading() block: a nested one (the same checkpoint) adds nothing

TRAINER_OPT_OUT = "pass `weights_only=False` to `trainer.fit`/`validate`/`test`/`predict` with this `ckpt_path`"
"""How a user of the strategy loads a checkpoint they trust that holds other objects."""


def restricted(weights_only: bool | None) -> bool:
    """Whether ``torch.load(..., weights_only=weights_only)`` unpickles tensors and plain types only.

    As torch decides it: ``None`` is torch's default (restricted), and its two environment variables win.
    """
    if _set(FORCE):
        return True
    if weights_only is None:
        return not _set(FORCE_NOT)
    return weights_only


def load(file: Path, weights_only: bool | None) -> Any:
    """``torch.load(file)`` onto the CPU, restricted unless ``weights_only`` is False (see :func:`restricted`)."""
    return torch.load(file, map_location="cpu", weights_only=restricted(weights_only))


@contextmanager
def reading(
    checkpoint: Path, weights_only: bool | None, opt_out: str = TRAINER_OPT_OUT, *, look: bool = True
) -> Iterator[None]:
    """Read the checkpoint directory ``checkpoint`` in the block, DeepSpeed's reads included, as ``weights_only`` says.

    Restricted, it first refuses a checkpoint whose files hold other objects than tensors, plain types and
    DeepSpeed's own (an ``UnpicklingError`` naming the file and ``opt_out``, how to load it anyway), then makes
    every ``torch.load`` in the block restricted. Not a collective: every rank decides the same from the files.
    ``look=False`` skips the first part, for a checkpoint an earlier block looked at already.
    """
    global _inside
    if _inside or not restricted(weights_only):
        yield
        return
    with torch.serialization.safe_globals(ds_compat.checkpoint_globals()), _forcing():
        for file in _loadable(checkpoint) if look else []:
            _refuse_unsafe(file, opt_out)
        _inside = True
        try:
            yield
        except pickle.UnpicklingError as error:  # an object the look at the pickles missed
            raise pickle.UnpicklingError(_refusal(str(checkpoint), _what(error), opt_out)) from error
        finally:
            _inside = False


def _loadable(checkpoint: Path) -> list[Path]:
    """The ``.pt`` files of ``checkpoint`` that a load may read: none inside a ``*.partial`` folder.

    Those are saves or conversions that did not finish (or are being written by rank 0 now): never loaded.
    A single-file checkpoint is its own one file.
    """
    if checkpoint.is_file():
        return [checkpoint]
    return sorted(
        file
        for file in checkpoint.rglob("*.pt")
        if not any(part.endswith(".partial") for part in file.relative_to(checkpoint).parts)
    )


def _refuse_unsafe(file: Path, opt_out: str) -> None:
    """Raise an UnpicklingError naming ``file`` if its pickle names a global that restricted loading refuses.

    A file this cannot read (not torch's zip format, truncated, gone) is left to ``torch.load``, restricted in
    the block, to accept or refuse.
    """
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except (ValueError, RuntimeError, OSError):
        return
    if unsafe:
        raise pickle.UnpicklingError(_refusal(str(file), ", ".join(sorted(unsafe)), opt_out))


def _what(error: pickle.UnpicklingError) -> str:
    """What torch's restricted unpickler refused, from its message (its line naming the global, when it has one)."""
    lines = [line.strip() for line in str(error).splitlines() if "WeightsUnpickler error:" in line]
    return f"an object it refused ({lines[0] if lines else str(error).strip()})"


def _refusal(where: str, what: str, opt_out: str) -> str:
    return (
        f"Refusing to load {where!r}: it holds {what}, which `weights_only` loading (torch's "
        "default) does not unpickle, because unpickling it could run code that came with the checkpoint. If you "
        f"trust where this checkpoint came from, {opt_out}."
    )


@contextmanager
def _forcing() -> Iterator[None]:
    """Set torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` in the block: ``torch.load(weights_only=False)`` restricts."""
    before = os.environ.get(FORCE)
    os.environ[FORCE] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE]
        else:
            os.environ[FORCE] = before


def _set(variable: str) -> bool:
    return os.environ.get(variable, "0").lower() in _TRUE
