"""``module.zero_grad()`` on a trained engine's submodule, or on the LightningModule, as under ``DDPStrategy``.

Under DDP, ``netD.zero_grad()`` (PyTorch's DCGAN tutorial clears its models this way, not through the optimizer)
sets the gradients the next ``optimizer.step()`` applies to None. An engine's gradients are not all in
``param.grad``: ZeRO-2/3 reduce them into flat partitions at each backward, which ``nn.Module.zero_grad`` does not
see, so the next step would apply them anyway. So for the fit each trained engine's module gets its own
``zero_grad`` (an instance attribute, removed at teardown) that clears the engine as ``opt.zero_grad()`` does, and
the LightningModule one that clears every trained engine and then its other parameters. A submodule inside an
engine's module clears only its own parameters, which a flat partition cannot do: it is refused while the engine
holds gradients, and is torch's own otherwise (there is nothing to clear).

A copy of such a module made during the fit (``copy.deepcopy``: a snapshot, a target network) gets torch's own
``zero_grad``: it is not the engine's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_multids._joined import part_names
from lightning_multids._record import EngineRecord


class _ZeroGrad:
    """The ``zero_grad`` put on ``module`` for the fit: ``clear(set_to_none)``.

    A deep copy of ``module`` gets its class's own instead.
    """

    def __init__(self, module: nn.Module, clear: Callable[[bool], None]) -> None:
        self._module, self._clear = module, clear

    def __call__(self, set_to_none: bool = True) -> None:
        self._clear(set_to_none)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = memo.get(id(self._module))  # the module being copied, made before its attributes are copied
        return type(copied).zero_grad.__get__(copied) if copied is not None else type(self._module).zero_grad


class _Removing(RemovableHandle):
    """A handle whose removal takes the instance ``zero_grad`` off each module again."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__(OrderedDict())  # a dict subclass: the handle refers to it weakly
        self._modules = modules

    def remove(self) -> None:
        for module in self._modules:
            if isinstance(module.__dict__.get("zero_grad"), _ZeroGrad):
                del module.__dict__["zero_grad"]
        self._modules = []


def route_zero_grad(record: EngineRecord, clear: Callable[[bool], None]) -> RemovableHandle:
    """Give ``record``'s module a ``zero_grad`` that calls ``clear(set_to_none)``; returns what takes it off.

    Each of its submodules gets one that refuses while the engine holds gradients (see the module's text).
    """
    root = record.engine.module
    parts = [(name, module) for name, module in root.named_modules() if module is not root]
    root.zero_grad = _ZeroGrad(root, clear)  # type: ignore[method-assign]
    for name, module in parts:
        module.zero_grad = _ZeroGrad(module, _part_zero_grad(record, name, module))  # type: ignore[method-assign]
    return _Removing([root, *(module for _, module in parts)])


def route_module_zero_grad(module: nn.Module, clears: list[Callable[[bool], None]]) -> RemovableHandle:
    """Give the LightningModule a ``zero_grad`` that runs ``clears``, then torch's; returns what takes it off.

    ``clears``: every trained engine's; torch's then clears the plain submodules' parameters too.
    """
    own = type(module).zero_grad.__get__(module)

    def zero_grad(set_to_none: bool = True) -> None:
        for clear in clears:
            clear(set_to_none)
        own(set_to_none)

    module.zero_grad = _ZeroGrad(module, zero_grad)  # type: ignore[method-assign]
    return _Removing([module])


def _part_zero_grad(record: EngineRecord, part: str, module: nn.Module) -> Callable[[bool], None]:
    own = type(module).zero_grad.__get__(module)
    parts = part_names(record.engine.module)  # an engine over several submodules: none of them is all of it
    whole = "its optimizer's `zero_grad()`" if parts else f"`self.{record.name}.zero_grad()` or its optimizer's "
    whole += "" if parts else "`zero_grad()`"
    called = f"`self.{part}`" if parts else f"`{part}`"

    def zero_grad(set_to_none: bool = True) -> None:
        if record.has_gradients:
            raise RuntimeError(
                f"`zero_grad()` of {called}, a part of the engine {record.name!r}, while the engine holds gradients: "
                "its reduced gradients are one flat partition for the whole engine, which cannot be cleared for a "
                f"part of it. Clear the whole engine ({whole}), or give the part its own optimizer (its own engine) "
                "if it is cleared on its own."
            )
        own(set_to_none)

    return zero_grad
