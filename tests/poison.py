"""Checkpoint files that run code when unpickled without ``weights_only``: each touches a marker file.

:func:`poison` replaces one entry of a saved dict with the same value wrapped so that unpickling it calls
:func:`touched` first. Loaded with ``weights_only=False`` the file gives back what it held (and the marker
exists); loaded with ``weights_only=True`` torch refuses it, since ``tests.poison.touched`` is no allowed global.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def touched(marker: str, value: Any) -> Any:
    """Create ``marker``, return ``value``: the code a poisoned file runs."""
    Path(marker).touch()
    return value


class Poisoned:
    """``value``, pickled as a call of :func:`touched`."""

    def __init__(self, marker: Path, value: Any) -> None:
        self.marker, self.value = str(marker), value

    def __reduce__(self) -> tuple[Any, tuple[str, Any]]:
        return touched, (self.marker, self.value)


def poison(file: Path, marker: Path) -> None:
    """Rewrite the dict saved in ``file`` with its first entry wrapped in :class:`Poisoned`."""
    state = torch.load(file, weights_only=False)
    key = next(iter(state))
    state[key] = Poisoned(marker, state[key])
    torch.save(state, file)
