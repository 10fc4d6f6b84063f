"""Find which submodule each optimizer trains and build one DeepSpeed engine per submodule.

An engine is keyed by the attribute name of its submodule on the LightningModule (``"generator"``).
The submodule stays where it is: ``self.generator`` is still the user's module, with all its
methods and attributes, and ``engine.module is self.generator``. DeepSpeed converts it in place
(device, dtype, ZeRO-3 partitioning, ZeRO-3 gather/release hooks); :func:`attach` adds one
forward pre-hook that casts floating-point inputs to the engine's dtype (bf16/fp16 engines), and
:func:`detach` removes everything again at teardown.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle


def parameter_owners(module: nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to the name of the direct child of ``module`` that holds it.

    Parameters held by ``module`` itself (not by a child) are left out.
    """
    owners: dict[int, str] = {}
    for name, child in module.named_children():
        for param in child.parameters():
            owners.setdefault(id(param), name)
    return owners


def match_optimizers(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, int]:
    """Return ``submodule name -> index of its optimizer`` for the optimizers of ``module``.

    Raises:
        ValueError: an optimizer holds parameters of several submodules, or of the LightningModule
            itself; a parameter is in two optimizers; two optimizers train one submodule.
    """
    owners = parameter_owners(module)
    seen: dict[int, int] = {}
    matched: dict[str, int] = {}
    for index, optimizer in enumerate(optimizers):
        names: dict[str, None] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in seen and seen[id(param)] != index:
                    raise ValueError(
                        f"A parameter of {owners.get(id(param), 'the LightningModule')!r} is in optimizer "
                        f"{seen[id(param)]} and optimizer {index}. Each parameter can be trained by one "
                        "optimizer only: remove it from one of them in `configure_optimizers`."
                    )
                seen[id(param)] = index
                names.setdefault(_owner_of(param, owners, index))
        matched.update(_one_submodule(names, index, matched))
    return matched


def _owner_of(param: torch.Tensor, owners: Mapping[int, str], index: int) -> str:
    owner = owners.get(id(param))
    if owner is None:
        raise ValueError(
            f"Optimizer {index} holds a parameter that belongs to the LightningModule itself, not to a "
            "submodule. MultiDeepSpeedStrategy builds one engine per submodule: move the parameter into a "
            "submodule (e.g. an `nn.Module` attribute) and optimize that."
        )
    return owner


def _one_submodule(names: Mapping[str, None], index: int, matched: Mapping[str, int]) -> dict[str, int]:
    if not names:
        raise ValueError(f"Optimizer {index} holds no parameters. Give it the parameters of one submodule.")
    if len(names) > 1:
        listed = " and ".join(repr(n) for n in names)
        raise ValueError(
            f"Optimizer {index} holds parameters of {listed}. MultiDeepSpeedStrategy gives each submodule its "
            "own DeepSpeed engine and optimizer: return one optimizer per submodule from "
            "`configure_optimizers`, or put the parts in one parent submodule."
        )
    (name,) = names
    if name in matched:
        raise ValueError(
            f"Optimizers {matched[name]} and {index} both train {name!r}. A DeepSpeed engine has one "
            "optimizer: use one optimizer with several parameter groups for this submodule."
        )
    return {name: index}


def check_engine_names(module: nn.Module, names: Iterable[str]) -> None:
    """Raise a ValueError for an ``engines`` key that is not a direct submodule of ``module``."""
    children = dict(module.named_children())
    for name in names:
        if name not in children:
            available = ", ".join(repr(c) for c in children) or "none"
            raise ValueError(
                f"`engines` has an entry for {name!r}, but {type(module).__name__} has no submodule of that "
                f"name. Submodules: {available}. Key each entry by the attribute name of a submodule."
            )


def build_engine(
    module: nn.Module,
    config: dict[str, Any],
    optimizer: Optimizer | None = None,
    scheduler: Any = None,
) -> DeepSpeedEngine:
    """Wrap ``module`` in a DeepSpeed engine with ``optimizer`` and ``scheduler`` (owned by the engine).

    Without ``optimizer``, DeepSpeed builds one from the config's ``optimizer`` section if it has one,
    over the module's trainable parameters. The engine steps its scheduler in ``engine.step()``.
    """
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        model_parameters=None if optimizer is not None else [p for p in module.parameters() if p.requires_grad],
        lr_scheduler=scheduler,
        config=config,
        dist_init_required=False,
    )
    return engine


def attach(name: str, engine: DeepSpeedEngine) -> list[RemovableHandle]:
    """Add what the strategy needs around a built engine; return the handles that :func:`detach` removes.

    Floating-point inputs of the submodule are cast to the engine's dtype on entry, and calling the
    engine itself is refused (:func:`refuse_direct_calls`).
    """
    refuse_direct_calls(name, engine)
    return [engine.module.register_forward_pre_hook(_cast_inputs(_engine_dtype(engine)), with_kwargs=True)]


def detach(engine: DeepSpeedEngine, handles: Iterable[RemovableHandle]) -> None:
    """Undo :func:`attach` and :func:`build_frozen_engine`'s eval patch, then destroy the engine.

    ``engine.destroy()`` removes DeepSpeed's ZeRO hooks (gradient hooks, ZeRO-3 gather/release hooks);
    the engine's forward hooks on the module are removed here. A ZeRO-3 submodule stays partitioned:
    ``deepspeed.zero.GatheredParameters`` reads it, and the next fit or evaluation builds an engine on it.
    A whole submodule of a bf16/fp16 engine goes back to torch's default dtype.
    """
    for handle in handles:
        handle.remove()
    engine.module.__dict__.pop("train", None)
    engine.destroy()
    # destroy() leaves the forward hooks the engine put on its module, and each ZeRO-3 parameter's link to
    # its optimizer (DeepSpeed 0.19.8): both would keep the engine alive as long as the module.
    for handle in (engine.module_forward_pre_hook, engine.module_forward_post_hook):
        if handle is not None:
            handle.remove()
    for param in engine.module.parameters():
        param.__dict__.pop("_z3_optimizer", None)
    if _engine_dtype(engine) != torch.float32 and not is_partitioned(engine.module):
        # Without the input cast, a bf16/fp16 module would fail on fp32 inputs outside fit. Back in fp32 it runs
        # as under DDP with mixed precision; a ZeRO-3 one gets an engine (and its cast) again when evaluated.
        engine.module.to(torch.get_default_dtype())


def build_frozen_engine(module: nn.Module, config: dict[str, Any]) -> DeepSpeedEngine:
    """Wrap ``module`` in an inference engine: no gradients, no optimizer, always in eval mode.

    ``Trainer.fit`` puts the LightningModule in train mode at every epoch; the frozen submodule ignores it
    until :func:`detach`.
    """
    module.requires_grad_(False)
    module.eval()
    module.train = types.MethodType(_stay_in_eval, module)  # type: ignore[method-assign]
    return build_engine(module, config)


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def _engine_dtype(engine: DeepSpeedEngine) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def _cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook that casts floating-point tensors among the inputs to ``dtype``."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return apply_to_collection(args, torch.Tensor, cast), apply_to_collection(kwargs, torch.Tensor, cast)

    return hook


def zero3_init(config: dict[str, Any]) -> Any:
    """A ``deepspeed.zero.Init`` context: modules built inside it are partitioned as they are created."""
    return deepspeed.zero.Init(config_dict_or_path=config, mem_efficient_linear=False)


def is_partitioned(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters partitioned by ZeRO-3 (built under ``zero.Init``)."""
    return any(hasattr(param, "ds_id") for param in module.parameters())


def unpartition(module: nn.Module) -> None:
    """Replace the ZeRO-3-partitioned parameters of ``module`` by whole, ordinary ones (a collective call).

    Used for submodules built under ``zero.Init`` in ``configure_model`` whose engine is not ZeRO-3.
    The parameter objects change, so this must run before an optimizer holds them. A parameter shared
    by several modules (tied weights) becomes one whole parameter, still shared. Floating-point ones get
    torch's default dtype, as if built without ``zero.Init`` (whose dtype is the ZeRO-3 engines').
    """
    partitioned = [param for param in module.parameters() if hasattr(param, "ds_id")]
    dtype = torch.get_default_dtype()  # what it would have been built in without zero.Init; its engine casts
    whole: dict[nn.Parameter, nn.Parameter] = {}
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        for child in module.modules():
            for name, param in list(child._parameters.items()):
                if param is not None and hasattr(param, "ds_id"):
                    if param not in whole:
                        data = param.data.to(dtype) if param.is_floating_point() else param.data
                        whole[param] = nn.Parameter(data.clone(), requires_grad=param.requires_grad)
                    child._parameters[name] = whole[param]


def refuse_direct_calls(name: str, engine: DeepSpeedEngine) -> None:
    """Make calling the engine itself (``engine(x)``) an error that points to the submodule.

    ``DeepSpeedEngine.forward`` registers DeepSpeed's own backward hooks on the outputs, which run a
    second prologue beside the strategy's routing and leave the engine's backward state broken.
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"The DeepSpeed engine {name!r} was called directly. Call the submodule instead (`self.{name}(x)` in "
            "the LightningModule): MultiDeepSpeedStrategy routes each backward through the engines itself, and "
            "`engine(x)` would add DeepSpeed's own backward hooks beside it."
        )

    engine.forward = forward  # type: ignore[method-assign]
