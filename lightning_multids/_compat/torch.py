"""torch's private names the strategy reads, each read from torch 2.11-2.15 (checked on 2.11, 2.13 and 2.15).

Every private torch name on the strategy's step path is here, so that a torch release that moves one breaks
one file.
"""

from __future__ import annotations

import functools
import operator
import re
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_params_and_buffers
from torch.optim import optimizer as _optimizer
from torch.utils import _pytree

queue_callback: Callable[[Callable[[], None]], None] = (
    getattr(torch.autograd.graph, "queue_callback", None) or torch.autograd.Variable._execution_engine.queue_callback
)
"""Run a function when the current backward's graph task ends: public from torch 2.15; before it (2.11-2.14) the
same call on the private execution engine."""

current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""Which (nested) backward runs now: each reentrant checkpoint's backward is its own graph task; -1 outside."""


will_execute: Callable[[Any], bool] = torch._C._will_engine_execute_node
"""Inside a backward: whether it runs the given autograd node (for a parameter's gradient accumulator: whether the
backward gives the parameter a gradient). Raises RuntimeError under ``torch.autograd.grad``."""


def leaf_spec_deprecated() -> bool:
    """Whether torch marks ``torch.utils._pytree.LeafSpec`` deprecated (PEP 702's ``__deprecated__``; read on 2.13).

    Lightning 2.6 builds one in every ``CombinedLoader``, and each build then warns.
    """
    return hasattr(getattr(_pytree, "LeafSpec", None), "__deprecated__")


def gradient_accumulator(param: torch.Tensor) -> Any:
    """The node that accumulates ``param``'s gradient into ``param.grad`` (it must require a gradient).

    torch keeps one per parameter for as long as something holds it (and makes a new one if its dtype or device
    changes); the holder asks :data:`will_execute` about it in each backward.
    """
    with torch.enable_grad():  # also inside a backward, which runs its hooks with gradients off
        return param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


class ForwardCounter:
    """Counts the forwards of some autograd Functions (reentrant activation checkpoints) while it is open.

    Each class's ``forward`` is wrapped once, however many counters are open; :meth:`close` unwraps it when the last
    counter of that class closes.
    """

    _open: dict[type, list[ForwardCounter]] = {}  # noqa: RUF012 - one registry for the process
    _originals: dict[type, Any] = {}  # noqa: RUF012

    def __init__(self, functions: tuple[type, ...]) -> None:
        self.count = 0
        self._functions = functions
        for function in functions:
            counters = self._open.setdefault(function, [])
            if not counters:
                self._wrap(function)
            counters.append(self)

    @classmethod
    def _wrap(cls, function: type) -> None:
        original = function.__dict__["forward"]
        cls._originals[function] = original
        forward = original.__func__ if isinstance(original, staticmethod) else original

        @functools.wraps(forward)
        def counted(*args: Any, **kwargs: Any) -> Any:
            for counter in cls._open.get(function, ()):
                counter.count += 1
            return forward(*args, **kwargs)

        function.forward = staticmethod(counted)  # type: ignore[attr-defined]

    def close(self) -> None:
        for function in self._functions:
            counters = self._open.get(function, [])
            if self in counters:
                counters.remove(self)
            if not counters and function in self._originals:
                function.forward = self._originals.pop(function)  # type: ignore[attr-defined]
                self._open.pop(function, None)
        self._functions = ()


_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|remote process exited|gloo/transport/.*Broken pipe")


def peer_failed(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed because another rank went away.

    No exception type says so: ``torch.distributed.DistError`` (NCCL's ``DistBackendError``, the store's
    ``DistNetworkError``) also covers misuse, a port in use and timeouts, and gloo raises a plain ``RuntimeError``
    (torch 2.11-2.15). So the message is read, for the words of a closed connection (gloo's transport, the store)
    or of NCCL's remote process that exited, and only on a ``RuntimeError`` (which ``DistError`` is).
    """
    return isinstance(exception, RuntimeError) and bool(_PEER_GONE.search(str(exception)))


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


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether a NaN or inf is in ``tensors``: one read per device.

    ``GradScaler``'s fused check (``torch._amp_foreach_non_finite_check_and_unscale_``) with a scale of 1, which
    leaves the values as they are: one multi-tensor kernel per device on a GPU, one C++ loop on a CPU (about 0.2 µs
    a tensor, against 1.3 µs for ``torch._foreach_norm``, the check before). Tensors all on the CPU go to it in one
    call whatever their dtypes (the CPU kernel checks each tensor in its own dtype); else they are grouped by
    device and dtype first. Where it has no kernel (bf16 on CUDA in torch 2.11-2.15, devices other than CPU and
    CUDA), ``isfinite`` of each tensor, read once with the rest.
    """
    # Every one on the CPU: with a meta tensor among them the call would go to the meta kernel, which checks nothing.
    if tensors and all(map(_IS_CPU, tensors)):
        flag = torch.zeros(1, dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, torch.ones(1, dtype=torch.float32))
        return bool(flag)
    return _any_nonfinite_by_group(tensors)


_IS_CPU = operator.attrgetter("is_cpu")


def _any_nonfinite_by_group(tensors: list[torch.Tensor]) -> bool:
    """:func:`any_nonfinite` with the tensors grouped by device and dtype: one kernel (or ``isfinite``) a group."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    flags: dict[torch.device, torch.Tensor] = {}
    for (device, dtype), group in groups.items():
        flag = flags.setdefault(device, torch.zeros(1, dtype=torch.float32, device=device))
        if _fused_check_runs_on(device, dtype):
            unit = torch.ones(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, unit)
        else:
            flag += torch.stack([torch.isfinite(tensor).all() for tensor in group]).logical_not().any()
    found = False
    for flag in flags.values():  # one read per device
        found = bool(flag) or found
    return found


def _fused_check_runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` has a kernel for ``dtype`` on ``device``."""
    return device.type == "cpu" or (device.type == "cuda" and dtype in (torch.float16, torch.float32, torch.float64))


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_HOOK_SIDE_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
"""``nn.Module``'s hook registries, and those keyed by the same hook ids (what ``RemovableHandle.remove`` clears)."""


def hooks_added_from_now(module: torch.nn.Module) -> Callable[[], None]:
    """Return what removes each hook registered on ``module`` or a submodule after this call, by anyone."""
    before = [(sub, name, set(getattr(sub, name))) for sub in module.modules() for name in _HOOK_DICTS]

    def remove() -> None:
        for sub, name, kept in before:
            hooks = getattr(sub, name)
            for key in [key for key in hooks if key not in kept]:
                del hooks[key]
                for side in _HOOK_SIDE_DICTS:
                    getattr(sub, side, {}).pop(key, None)

    return remove


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (a wrapper around the original module)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def synced_buffers(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The buffers of ``module`` that DDP broadcasts: all but those named in ``_ddp_params_and_buffers_to_ignore``."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return tuple(buffer for name, buffer in module.named_buffers() if name not in ignore)


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Broadcast rank 0's buffers of ``module`` in coalesced buckets; a collective call.

    What ``DistributedDataParallel`` does before a forward with ``broadcast_buffers=True`` (``_sync_buffers``, which
    calls ``torch.distributed.utils._sync_params_and_buffers`` with 250 MiB buckets from rank 0), leaving out the
    buffers named in ``module._ddp_params_and_buffers_to_ignore`` as it does.
    """
    buffers = synced_buffers(module)
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


WRITING_COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "reduce",
    "scatter",
    "recv",
    "irecv",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
)
"""The collectives of ``torch.distributed`` that write into a tensor they are given."""


def watch_collective_writes(written: Callable[[torch.Tensor], None], unwatched: tuple[str, ...]) -> Callable[[], None]:
    """Call ``written(tensor)`` for every tensor a :data:`WRITING_COLLECTIVES` call gets; return the undo.

    Only for calls looked up in ``torch.distributed`` at the call (``dist.broadcast(p, 0)``), from a module whose name
    does not start with one of ``unwatched`` (DeepSpeed's own collectives pass through its ``deepspeed.comm``, at the
    cost of one frame look-up each). A collective writes a tensor's storage without raising its version counter.
    """
    module = torch.distributed

    def watched(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not sys._getframe(1).f_globals.get("__name__", "").startswith(unwatched):
                for value in (*args, *kwargs.values()):
                    for tensor in value if isinstance(value, list | tuple) else (value,):
                        if isinstance(tensor, torch.Tensor):
                            written(tensor)
            return function(*args, **kwargs)

        return collective

    patches = [(name, watched(getattr(module, name))) for name in WRITING_COLLECTIVES if hasattr(module, name)]
    originals = [(name, getattr(module, name)) for name, _ in patches]
    for name, patched in patches:
        setattr(module, name, patched)

    def undo() -> None:
        for (name, original), (_, patched) in zip(originals, patches, strict=True):
            if getattr(module, name) is patched:  # another patch made since stays
                setattr(module, name, original)

    return undo


def storage_of(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s storage starts: the same for every view of it (0 for a tensor without one)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass or meta tensor without a plain storage
        return 0


_TENSOR_ATTRIBUTES: dict[str, Any] = {name: torch._C.TensorBase.__dict__[name] for name in ("grad", "data")}
"""The descriptors behind every tensor's ``.grad`` and ``.data``, on torch's private tensor base class."""


class ParameterGuard:
    """Runs ``checks[attribute](param, reader, verb)`` before an access to ``param.grad`` or ``param.data``.

    ``reader`` is the ``__name__`` of the module whose code reads or writes, ``verb`` "read" or "set". A check runs
    while its attribute is enabled and not suspended. ``grad`` and ``data`` are data descriptors of the tensor base
    class, so an access cannot be seen on the instance: while some check runs, each parameter's class is a subclass
    (one per class, named as the original, so that printing and pickling are unchanged; ``copy.deepcopy`` gives the
    original) whose properties check, then access the same attribute; deletes pass through, and autograd's C++
    engine does not go through them. Otherwise the parameters have their own class, and accesses cost what they
    cost without the guard.
    """

    def __init__(self, params: list[torch.nn.Parameter], checks: Mapping[str, Check]) -> None:
        self._enabled: set[str] = set()
        self._suspended: Counter[str] = Counter()
        self._active: set[str] = set()  # read by the properties: changed in place
        classes: dict[type, type] = {}
        for param in params:
            if type(param) not in classes:
                classes[type(param)] = _guarded_class(type(param), checks, self._active)
        self._pairs = [(param, type(param), classes[type(param)]) for param in params]
        self._swapped = False

    def enable(self, attribute: str) -> None:
        """Check ``attribute`` from now on, unless suspended."""
        self._enabled.add(attribute)
        self._update()

    def disable(self, attribute: str) -> None:
        """Stop checking ``attribute``."""
        self._enabled.discard(attribute)
        self._update()

    def suspend(self, *attributes: str) -> None:
        """Stop checking ``attributes`` (default: all) until as many :meth:`resume` calls as :meth:`suspend` calls."""
        for attribute in attributes or _TENSOR_ATTRIBUTES:
            self._suspended[attribute] += 1
        self._update()

    def resume(self, *attributes: str) -> None:
        """Undo one :meth:`suspend` of the same ``attributes``."""
        for attribute in attributes or _TENSOR_ATTRIBUTES:
            self._suspended[attribute] -= 1
        self._update()

    @contextmanager
    def suspended(self, *attributes: str) -> Iterator[None]:
        """No check of ``attributes`` (default: all) in the body: one update of the parameters' classes each way."""
        self.suspend(*attributes)
        try:
            yield
        finally:
            self.resume(*attributes)

    def close(self) -> None:
        """Check nothing from now on: the parameters' own classes back."""
        self._enabled.clear()
        self._update()

    def _update(self) -> None:
        active = self._active
        active.clear()
        if self._enabled:
            active.update(a for a in self._enabled if self._suspended[a] <= 0)
        if bool(active) != self._swapped:
            self._swapped = bool(active)
            for param, original, guarded in self._pairs:
                param.__class__ = guarded if self._swapped else original


Check = Callable[[torch.Tensor, str, str], None]
"""``check(param, reader, verb)``: raises to refuse the access."""


def _guarded_class(original: type, checks: Mapping[str, Check], active: set[str]) -> type:
    def deepcopy(param: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        copied = getattr(original, "__deepcopy__")(param, memo)  # noqa: B009
        if isinstance(copied, original):  # made as `type(param)(...)`: the copy is not guarded
            copied.__class__ = original
        return copied

    namespace: dict[str, Any] = {"__module__": original.__module__, "__qualname__": original.__qualname__}
    namespace["__deepcopy__"] = deepcopy
    for attribute, check in checks.items():
        namespace[attribute] = _checked_property(attribute, check, active)
    return type(original)(original.__name__, (original,), namespace)


def _same_tensor(current: Any, value: Any) -> bool:
    """Whether setting ``value`` changes nothing: a view of ``current``'s memory with its shape, strides and dtype.

    ``p.data = p.data.to(device, dtype)`` where both match already (pytorch-metric-learning's losses do it in each
    forward) hands the tensor back to itself.
    """
    return (
        isinstance(current, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and value.data_ptr() == current.data_ptr()
        and value.shape == current.shape
        and value.stride() == current.stride()
        and value.dtype == current.dtype
        and value.device == current.device
    )


def _checked_property(attribute: str, check: Check, active: set[str]) -> property:
    def read(param: torch.Tensor) -> Any:
        if attribute in active:
            check(param, sys._getframe(1).f_globals.get("__name__", ""), "read")
        return _TENSOR_ATTRIBUTES[attribute].__get__(param)

    def write(param: torch.Tensor, value: Any) -> None:
        if attribute in active and not _same_tensor(_TENSOR_ATTRIBUTES[attribute].__get__(param), value):
            check(param, sys._getframe(1).f_globals.get("__name__", ""), "set")
        _TENSOR_ATTRIBUTES[attribute].__set__(param, value)

    def delete(param: torch.Tensor) -> None:
        _TENSOR_ATTRIBUTES[attribute].__delete__(param)

    return property(read, write, delete)


def versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's version counter (torch's ``Tensor._version``): an in-place op on the tensor itself raises it.

    An op on ``tensor.data`` (a tensor of its own) does not, nor does a write through another view of its storage.
    """
    return [tensor._version for tensor in tensors]
