"""One engine over several submodules: the ones one optimizer trains (a VQGAN's encoder, decoder and quantizer).

DeepSpeed builds an engine over one module. Where an optimizer of ``configure_optimizers`` holds parameters of
several submodules (attributes) of the LightningModule, its engine is built over a :class:`Joined` container whose
children are those submodules under their attribute names, in the LightningModule's order. The container is no
attribute of the LightningModule (a module may have two parents): ``self.encoder`` stays the user's module, called
directly, and the LightningModule's ``state_dict`` keys do not change. The engine is named after its first part.

The container's own ``forward`` never runs (the strategy never calls an engine's forward, and user code calls the
parts), so what the strategy hooks on an engine's module for each call (the input cast, the check of a backward
outside a route) goes on each part instead: :func:`called_modules`. Checkpoints save the engine as DeepSpeed does,
keyed ``encoder.x``, ``decoder.y`` within it; what users read back (``consolidated_state_dicts``, ``export``) is
split into one dict per part (:func:`split_state`).

This module imports nothing of the package, so each module can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

V = TypeVar("V")


class Joined(nn.Module):
    """The submodules one optimizer trains, as children under their attribute names: the module of their engine."""

    def __init__(self, parts: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        names = ", ".join(f"`self.{name}(...)`" for name, _ in self.named_children())
        raise RuntimeError(f"An engine over several submodules is never called itself: call its parts ({names}).")


def called_modules(module: nn.Module) -> list[nn.Module]:
    """The modules user code calls for an engine over ``module``: its parts where it is :class:`Joined`, else itself."""
    return list(module.children()) if isinstance(module, Joined) else [module]


def part_names(module: nn.Module) -> list[str] | None:
    """The attribute names of the parts of a :class:`Joined` ``module``; None for any other module."""
    return [name for name, _ in module.named_children()] if isinstance(module, Joined) else None


def split_state(state: Mapping[str, V], parts: list[str]) -> dict[str, dict[str, V]]:
    """A joined engine's ``state`` (keys ``part.key``) as one dict per part, keys relative to the part."""
    split: dict[str, dict[str, V]] = {part: {} for part in parts}
    for key, value in state.items():
        part, _, rest = key.partition(".")
        split[part][rest] = value
    return split
