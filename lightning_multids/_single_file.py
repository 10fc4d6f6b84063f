"""A checkpoint directory carried inside one file: each file's bytes as a ``uint8`` tensor, by its relative path.

``MultiDeepSpeedStrategy(checkpoint_format="file")`` writes one file that ``torch.load(weights_only=True)`` reads: its
top level holds what Lightning's own single-file checkpoint holds (whole weights under ``state_dict``), and the
directory the engines saved (:mod:`lightning_multids.checkpoint`) travels in it as bytes, so that a resume loads each
engine's state exactly as from the directory. Bytes in a ``uint8`` tensor unpickle under ``weights_only=True``; each
file unpacked is then loaded as the directory's files are (restricted, :mod:`lightning_multids._loading`).

This module imports nothing of the package, so each module can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


def packed_files(directory: Path) -> dict[str, torch.Tensor]:
    """Every file under ``directory`` as a ``uint8`` tensor of its bytes, keyed by its path relative to it."""
    return {
        file.relative_to(directory).as_posix(): _as_tensor(file.read_bytes())
        for file in sorted(directory.rglob("*"))
        if file.is_file()
    }


def unpack_files(files: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Write each of ``files`` (:func:`packed_files`) under ``directory``; a path leaving it is a ValueError."""
    root = directory.resolve()
    for relative, data in files.items():
        target = (root / str(relative)).resolve()
        if not target.is_relative_to(root) or target == root:
            raise ValueError(f"A packed checkpoint file names {relative!r}, outside its directory.")
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"The packed checkpoint file {relative!r} is not a file's bytes (a 1-D uint8 tensor).")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.numpy().tobytes())
        except OSError as error:  # two entries `a` and `a/b`: no checkpoint this strategy wrote
            raise ValueError(f"The packed checkpoint file {relative!r} cannot be written out: {error}") from error


def _as_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
