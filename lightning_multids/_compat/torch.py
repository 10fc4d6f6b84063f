"""torch's private names the strategy reads, each read from torch 2.11-2.15 (checked on 2.11, 2.13 and 2.15).

Every private torch name on the strategy's step path is here, so that a torch release that moves one breaks
one file.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_params_and_buffers
from torch.optim import optimizer as _optimizer

queue_callback: Callable[[Callable[[], None]], None] = (
    getattr(torch.autograd.graph, "queue_callback", None) or torch.autograd.Variable._execution_engine.queue_callback
)
"""Run a function when the current backward's graph task ends: public from torch 2.15; before it (2.11-2.14) the
same call on the private execution engine."""

current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""Which (nested) backward runs now: each reentrant checkpoint's backward is its own graph task; -1 outside."""


def accumulates_into() -> bool:
    """Inside a parameter's tensor hook: whether this backward will accumulate the gradient into ``param.grad``.

    ``_current_autograd_node`` is the parameter's gradient accumulator; ``_will_engine_execute_node`` on it says
    whether the running backward executes it, and refuses to answer under ``torch.autograd.grad`` (which accumulates
    nothing). False outside a backward.
    """
    node = torch._C._current_autograd_node()
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # "... we are currently running autograd.grad()": nothing is accumulated
        return False


def step_hooks_or_profiler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` must go through torch's hook runner (``Optimizer.profile_hook_step``).

    True where a step hook is registered on the optimizer (``_optimizer_step_pre_hooks``/``_post_hooks``) or
    globally (``register_optimizer_step_pre_hook``: ``_global_optimizer_pre_hooks``/``_post_hooks``), or where the
    autograd profiler records (the runner's ``record_function`` region).
    """
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _optimizer._global_optimizer_pre_hooks
        or _optimizer._global_optimizer_post_hooks
        or torch._C._autograd._profiler_enabled()
    )


def init_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that does not call ``Optimizer.__init__`` the hook registries torch's step hooks use.

    ``register_step_pre_hook``/``_post_hook`` and torch's hook runner read ``_optimizer_step_pre_hooks`` and
    ``_optimizer_step_post_hooks`` (ordered dicts, set in ``Optimizer.__init__``).
    """
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()


def forward_class(node: Any) -> type | None:
    """The ``autograd.Function`` subclass whose backward an autograd node runs (``_forward_cls``), or None."""
    return getattr(node, "_forward_cls", None)


def step_post_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., None]]:
    """The step post hooks torch's runner would call after ``optimizer.step()``: the optimizer's, then the global ones.

    ``Optimizer.profile_hook_step`` reads them after the step body, so a hook registered during the step runs.
    """
    return [*optimizer._optimizer_step_post_hooks.values(), *_optimizer._global_optimizer_post_hooks.values()]


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in fp32, in one call (``torch._foreach_norm``).

    One fused kernel per device and dtype on a GPU, one C++ loop on a CPU (where ``torch.nn.utils.get_total_norm``
    loops in Python instead). In fp32 whatever the tensors' dtype: an fp16 tensor's norm passes 65504 long before
    its elements do.
    """
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (a wrapper around the original module)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Broadcast rank 0's buffers of ``module`` in coalesced buckets; a collective call.

    What ``DistributedDataParallel`` does before a forward with ``broadcast_buffers=True`` (``_sync_buffers``, which
    calls ``torch.distributed.utils._sync_params_and_buffers`` with 250 MiB buckets from rank 0), leaving out the
    buffers named in ``module._ddp_params_and_buffers_to_ignore`` as it does.
    """
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    buffers = tuple(buffer for name, buffer in module.named_buffers() if name not in ignore)
    if not buffers:
        return
    # As DDP: the write is hidden from autograd, so a graph that saved a buffer (an eval-mode BatchNorm's running
    # mean) and is backpropagated later does not fail on a changed version.
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers):
        _sync_params_and_buffers(_get_default_group(), list(buffers), 250 * 1024 * 1024, 0)


def guard_gradient_clipping(check: Callable[[str, list[torch.Tensor]], None]) -> Callable[[], None]:
    """Call ``check(function, parameters)`` before torch's gradient clipping clips; return the undo.

    ``clip_grad_norm_`` is covered however it was imported: it looks up the private ``_clip_grads_with_norm_``
    at each call and hands it the parameters (torch 2.11-2.15). ``clip_grad_value_`` and the public
    ``clip_grads_with_norm_`` (the second half of ``get_total_norm`` then ``clip_grads_with_norm_``) are covered
    where they are looked up in ``torch.nn.utils`` (or ``torch.nn.utils.clip_grad``) at the call, not as names
    imported before the fit.
    """
    clip_grad, utils = torch.nn.utils.clip_grad, torch.nn.utils

    def checked(function: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            check(name, parameters)
            return function(parameters, *args, **kwargs)

        return clip

    by_value = checked(clip_grad.clip_grad_value_, "clip_grad_value_")
    patches = [
        (clip_grad, "_clip_grads_with_norm_", checked(clip_grad._clip_grads_with_norm_, "clip_grad_norm_")),
        (clip_grad, "clip_grad_value_", by_value),
        (utils, "clip_grad_value_", by_value),
        (utils, "clip_grads_with_norm_", checked(utils.clip_grads_with_norm_, "clip_grads_with_norm_")),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, patched in patches:
        setattr(module, name, patched)

    def undo() -> None:
        for (module, name, original), (_, _, patched) in zip(originals, patches, strict=True):
            if getattr(module, name) is patched:  # another patch made since stays
                setattr(module, name, original)

    return undo
