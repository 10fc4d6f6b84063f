"""The optimizer Lightning sees for each engine: ``self.optimizers()`` returns one per engine."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.torch import init_step_hooks, step_hooks_or_profiler, step_post_hooks
from lightning_multids._nonfinite import NonFiniteGradients, skip_nonfinite_steps
from lightning_multids._record import EngineRecord, Phase


class _GroupView(MutableMapping):
    """A parameter group of the engine's optimizer whose ``"params"`` are the module's own parameters.

    DeepSpeed replaces ``param_groups[i]["params"]`` with flat fp32 partitions (ZeRO-1/2, bf16) or
    empties it (ZeRO-3). Lightning's ``toggle_optimizer`` and user code expect the module's
    parameters there; every other key (``lr``, ``momentum``...) reads and writes the live group.
    """

    def __init__(self, group: dict[str, Any], params: list[torch.nn.Parameter]) -> None:
        self._group = group
        self._params = params

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise ValueError(
                "The parameters of a DeepSpeed engine's optimizer are fixed when the engine is built; "
                "choose them in `configure_optimizers`."
            )
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)


class _StateView(MutableMapping):
    """DeepSpeed's optimizer state (keyed by its flat partitions or fp32 copies), refusing the module's parameters.

    ``opt.state[param]`` is ``torch.optim``'s way to read or reset one parameter's moments; where DeepSpeed holds
    them elsewhere, the touch is refused naming DeepSpeed's per-parameter helpers, instead of an empty dict (then
    ``KeyError: 'exp_avg'``) or an edit that reaches nothing. What the state holds passes through: its own keys,
    and iterating, as Lightning's own walks over optimizer state (moving it to a device) expect.
    """

    def __init__(self, state: MutableMapping, params: set[torch.nn.Parameter], refusal: Callable[..., str]) -> None:
        self._state, self._params, self._refusal = state, params, refusal

    def _check(self, key: Any, verb: str, helper: str) -> None:
        if isinstance(key, torch.Tensor) and key in self._params and key not in self._state:
            raise RuntimeError(self._refusal("state[param]", verb, helper))

    def __getitem__(self, key: Any) -> Any:
        self._check(key, "read", "safe_get_full_optimizer_state")
        return self._state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check(key, "set", "safe_set_full_optimizer_state")
        self._state[key] = value

    def __delitem__(self, key: Any) -> None:
        self._check(key, "set", "safe_set_full_optimizer_state")
        del self._state[key]

    def __contains__(self, key: object) -> bool:
        self._check(key, "read", "safe_get_full_optimizer_state")
        return key in self._state

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class EngineOptimizer(Optimizer):
    """Steps and clears one DeepSpeed engine; what ``self.optimizers()`` returns under the strategy.

    * ``step()`` runs ``engine.step()``: the optimizer, the scheduler of the engine's DeepSpeed config if it
      has one, and DeepSpeed's own gradient reset (DeepSpeed clears gradients after every step).
    * ``zero_grad()`` clears the module's gradients and any gradient DeepSpeed has already reduced
      into its partitions since the last step, and ends a ``clip_gradients`` meant for those gradients.
    * ``param_groups`` show the module's own parameters, so ``toggle_optimizer`` works.
    * step hooks (``opt.register_step_pre_hook``/``_post_hook``, torch's global ones) run around ``step()``,
      as around any torch optimizer's.

    Its state between steps (whether it holds gradients, a clipping pending for its next step, the blocks it is
    inside, its phase) is its engine's record's: ``self.optimizers()`` returns a ``LightningOptimizer`` that forwards
    attribute reads to this optimizer but keeps attribute writes for itself, so the methods write the record, which
    both see.

    Args:
        record: the engine's record (its name, its engine, and the state above).
        optimizer: the optimizer from ``configure_optimizers`` the engine was built with.
        params: that optimizer's parameters per group, recorded before DeepSpeed replaced them.
    """

    def __init__(
        self,
        record: EngineRecord,
        optimizer: Optimizer,
        params: Sequence[list[torch.nn.Parameter]],
    ) -> None:
        # Optimizer.__init__ is not called: the parameters and state live in the engine's optimizer. What torch's
        # step hooks need is set here; `step` runs them through torch's hook runner (`_stepped_with_hooks`).
        self.record = record
        self.name = record.name
        self.engine = record.engine
        self.optimizer = optimizer
        self._params = list(params)
        self.defaults = optimizer.defaults
        init_step_hooks(self)
        self.manual = True
        """Whether the module runs manual optimization (set by the strategy)."""
        self.after_step: Callable[[str], None] | None = None
        """Called with the engine's name after each applied step (the EMA engines that follow it)."""
        self._handle = skip_nonfinite_steps(self.engine)

    @property
    def has_gradients(self) -> bool:
        """Whether a backward reached the engine since its last step or ``zero_grad`` (its record's)."""
        return self.record.has_gradients

    def unguarded(self) -> AbstractContextManager[None]:
        """No check of its parameters' ``grad`` and ``data`` in the body (DeepSpeed's own accesses: at no cost)."""
        guard = self.record.guard
        return nullcontext() if guard is None else guard.suspended()

    @property
    def param_groups(self) -> list[MutableMapping]:  # type: ignore[override]
        """The engine optimizer's parameter groups, holding the module's parameters."""
        return [_GroupView(g, p) for g, p in zip(self.optimizer.param_groups, self._params, strict=True)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: an engine's parameters are fixed when it is built, so a group added later would never train."""
        raise ValueError(
            f"`add_param_group(...)` on the optimizer of engine {self.name!r}: a DeepSpeed engine's parameters are "
            "fixed when it is built (its ZeRO partitions and fp32 copies are made then), so a group added now would "
            "never train (Lightning's `BackboneFinetuning` and `BaseFinetuning.unfreeze_and_add_param_group` add "
            "one). Give the layers to unfreeze later their optimizer in `configure_optimizers` from the start (a "
            "group of their engine's optimizer, or an optimizer of their own submodule) with `lr` 0 and "
            "`requires_grad=True`, and set that group's `lr` when unfreezing (`opt.param_groups[i]['lr'] = ...`)."
        )

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The torch optimizer's per-parameter state at ZeRO-0 in fp32; elsewhere DeepSpeed's, refusing parameters.

        There the state is in flat partitions or fp32 copies, not under the parameter (see :class:`_StateView`).
        """
        if self._torch_holds_the_state():
            return self.optimizer.state
        params = {param for group in self._params for param in group}
        return _StateView(self.optimizer.state, params, self._no_torch_state)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The torch optimizer's ``state_dict()`` where it is the engine's optimizer (ZeRO-0 in fp32); else refused.

        Everywhere else DeepSpeed keeps the state in flat partitions or fp32 copies, not per parameter: the error
        names what to use instead.
        """
        if not self._torch_holds_the_state():
            raise RuntimeError(self._no_torch_state("state_dict()", "read", "safe_get_full_optimizer_state"))
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """The torch optimizer's ``load_state_dict`` at ZeRO-0 in fp32 (see :meth:`state_dict`); else refused."""
        if not self._torch_holds_the_state():
            raise RuntimeError(self._no_torch_state("load_state_dict(...)", "set", "safe_set_full_optimizer_state"))
        self.engine.optimizer.load_state_dict(state_dict)

    def _torch_holds_the_state(self) -> bool:
        """Whether DeepSpeed steps the torch optimizer itself (ZeRO-0, fp32): its state is per parameter.

        (Read through the engine: ``self.optimizer`` is Lightning's own attribute on its ``LightningOptimizer``.)
        """
        return self.engine is not None and self.engine.optimizer is ds_compat.torch_optimizer(self.engine)

    def _no_torch_state(self, call: str, verb: str, helper: str) -> str:
        stage = self.engine.zero_optimization_stage() if self.engine is not None else 0
        value = ", value" if verb == "set" else ""
        per_parameter = (
            f' To {verb} one parameter\'s state, call `deepspeed.utils.{helper}(param{value}, "exp_avg")` on every '
            "rank (a collective)."
            if stage
            else ""
        )
        return (
            f"`opt.{call}` of engine {self.name!r}: DeepSpeed keeps this optimizer's state "
            + ("in its own flat fp32 partitions" if stage else "beside fp32 copies of the 16-bit weights")
            + ", not in torch's per-parameter form. To save or resume it, use `trainer.save_checkpoint(path)` and "
            "`trainer.fit(model, ckpt_path=path)`, which write and read every engine's part." + per_parameter
        )

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run the closure if given (``step(closure)``, automatic optimization), then step the engine.

        Step hooks (on this optimizer, its ``LightningOptimizer`` or torch's global ones) run around it, inside
        torch's profiler region, as ``Optimizer.__init__`` arranges for every torch optimizer. With no hook
        registered and no profiler recording when the step starts, that runner and its region are skipped; post
        hooks registered during the step (in the closure) still run after it, as the runner would run them. (An
        ``ExecutionTraceObserver`` recording without ``torch.profiler`` does not see the region then.)

        Without a gradient since the last step or ``zero_grad``: in manual optimization this is an error
        (nothing would train); in automatic optimization (``training_step`` returned ``None``) the step is
        skipped, as Lightning does. A NaN or inf gradient refuses the step on every rank. Whether it
        succeeds or raises, the step ends with the gradients cleared and the engine's own clipping back.
        """
        _check_step_arguments(self.name, self.optimizer, {k: v for k, v in kwargs.items() if k != "closure"})
        if step_hooks_or_profiler(self):
            return self._stepped_with_hooks(*args, **kwargs)
        loss = self._step(*args, **kwargs)
        for hook in step_post_hooks(self):  # registered during the step
            hook(self, (self, *args), kwargs)
        return loss

    def _step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.record.refuse_step()
        if not self.has_gradients:
            self._refuse_empty_step()
            return loss  # automatic optimization: training_step returned None, Lightning skips the step
        step, skipped = self.engine.global_steps + 1, self.engine.skipped_steps
        with self.record.in_phase(Phase.STEP), self.unguarded():  # DeepSpeed's accesses, and the EMA's after it
            applied = self._step_engine(skipped, kwargs)
            if applied and self.after_step is not None:
                self.after_step(self.name)
        if not applied:
            self._report_skipped_step(step)
        return loss

    def _step_engine(self, skipped: int, kwargs: dict[str, Any]) -> bool:
        """Step the engine; whether the step was applied. It ends with the gradients cleared, whatever happens."""
        returned = False
        try:
            self.record.take_edits()  # edits since the last step reach the fp32 master copy
            restore = self.record.hold_untouched()  # parameters without a gradient: as torch.optim leaves them
            refreeze = self.record.thaw_held_gradients()  # frozen ones holding a gradient: stepped with it
            try:
                with _passing(self.optimizer, kwargs):
                    self.engine.step()
            finally:  # also where a step hook raised after the optimizer stepped
                if refreeze is not None:
                    refreeze()
                if restore is not None:
                    restore()
            returned = True
            return self.engine.skipped_steps == skipped
        except NonFiniteGradients:  # stage 0, fp32: raised before the torch optimizer changed anything
            ds_compat.abandon_step(self.engine)  # raised inside engine.step(): end its boundary
            return False
        except BaseException:
            ds_compat.abandon_step(self.engine)
            raise
        finally:
            if returned:  # engine.step() cleared the gradients, applied or skipped, all but what it leaves
                ds_compat.clear_after_step(self.engine)
                self._forget_gradients()
            else:  # gradients it had half processed (out of memory in the optimizer), or a refused step
                self.zero_grad()

    @Optimizer.profile_hook_step
    def _stepped_with_hooks(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(*args, **kwargs)

    def _refuse_empty_step(self) -> None:
        if self.manual:
            raise ValueError(
                f"`opt.step()` of engine {self.name!r} was called with no gradient since its last step or "
                "`zero_grad()`: no `self.manual_backward(loss)` reached this engine (or a `backward` override of the "
                "LightningModule skipped it), so the step would do nothing. "
                "Call `self.manual_backward(loss)` on a loss computed from this submodule first (not "
                "`loss.backward()`), and `zero_grad()` before the backward, not between the backward and the step. "
                "Where the loss reaches this engine on some ranks only, use "
                "`MultiDeepSpeedStrategy(find_unused_parameters=True)`: the ranks then agree after each backward."
            )

    def _report_skipped_step(self, step: int) -> None:
        """DeepSpeed skipped this step (no weights changed): warn for an fp16 overflow, raise for a NaN or inf."""
        if self.engine.fp16_enabled():
            rank_zero_warn(
                f"Engine {self.name!r} skipped its step {step}: the fp16 gradients overflowed; "
                "DeepSpeed lowered the loss scale."
            )
            return
        raise FloatingPointError(
            f"A gradient of engine {self.name!r} is NaN or infinite at its step {step} (on at least one rank). The "
            f"step was not applied, so the weights of {self.name!r} and of every other engine are unchanged. Look "
            "for a NaN or inf in the loss or in the inputs of this engine, or lower the learning rate; with fp16, "
            "DeepSpeed's loss scaler skips such steps on its own."
        )

    def clip_next_step(self, max_norm: float) -> None:
        """Clip this engine's gradients to global norm ``max_norm`` in its next ``step()`` only.

        DeepSpeed clips inside ``step()``, after the gradients are reduced across ranks, which is where
        ``self.clip_gradients(opt, gradient_clip_val=...)`` before ``opt.step()`` means to clip.
        """
        if self.record.configured_clipping is None:
            self.record.configured_clipping = float(self.engine.gradient_clipping())
        ds_compat.set_gradient_clipping(self.engine, max_norm)

    @property
    def pending_clip(self) -> float | None:
        """The global norm a :meth:`clip_next_step` since the last clear will clip to in ``step()``; else None."""
        return None if self.record.configured_clipping is None else float(self.engine.gradient_clipping())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this engine's gradients, local and already reduced, and forget a pending :meth:`clip_next_step`.

        Every gradient an engine receives comes through a routed backward, which sets ``has_gradients``;
        without one since the last clear there is nothing to clear.
        """
        kept = self.record.without_gradient
        if self.has_gradients:
            ds_compat.clear_gradients(self.engine)
        self._forget_gradients()
        if not set_to_none:  # torch's zeros where there was a gradient: those are stepped, the others still not
            self.record.without_gradient = kept

    def _forget_gradients(self) -> None:
        """After the gradients were cleared: none until the next backward, and no pending :meth:`clip_next_step`."""
        record = self.record
        record.has_gradients = False
        if record.configured_clipping is not None:  # clipping was for the gradients just cleared
            ds_compat.set_gradient_clipping(self.engine, record.configured_clipping)
            record.configured_clipping = None

    def release(self) -> None:
        """Remove the hook this optimizer put on the user's optimizer; the engine is gone after it (teardown)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.record.configured_clipping = None
        self.record.has_gradients = False
        self.engine = None  # type: ignore[assignment]
        # The engine set keeps the record (and the engine) for `trainer.save_checkpoint` after fit; the optimizer,
        # which the module's `self.optimizers()` may keep longer, holds a record of its own without the engine.
        self.record = EngineRecord(self.name, None, trainable=True)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        """The engine's name, then the optimizer it steps as torch shows it (its class and each group's settings).

        Wrapped by Lightning (``self.optimizers()``), ``LightningEngineOptimizer(...)``: Lightning's class name and
        the rest once, as Lightning shows a ``LightningSGD``, whose ``optimizer`` is this object.
        """
        stepped = self.optimizer
        while isinstance(stepped, EngineOptimizer):  # `self` is Lightning's wrapper: its `optimizer` is this one
            stepped = stepped.optimizer
        return f"{type(self).__name__}(engine={self.name!r}) over {stepped!r}"


def _check_step_arguments(name: str, optimizer: Optimizer, kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments of ``opt.step(...)`` that the optimizer's own ``step`` does not take, naming them."""
    if not kwargs:
        return
    try:
        parameters = inspect.signature(optimizer.step).parameters.values()
    except (TypeError, ValueError):  # a step written in C shows no signature: let it say for itself
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    taken = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    unknown = sorted(set(kwargs) - taken)
    if unknown:
        kind = type(optimizer)
        raise TypeError(
            f"`opt.step({', '.join(f'{key}=...' for key in unknown)})` of engine {name!r}: "
            f"`{kind.__module__}.{kind.__qualname__}.step` takes no argument {unknown[0]!r}, so it cannot be passed "
            f"on. Remove it, or give {name!r} an optimizer whose `step` takes it."
        )


@contextmanager
def _passing(optimizer: Optimizer, kwargs: dict[str, Any]) -> Iterator[None]:
    """While the engine steps, its torch optimizer's ``step`` also gets ``kwargs`` (``opt.step(closure, **kwargs)``).

    DeepSpeed calls ``optimizer.step()`` itself, on the whole parameters at ZeRO-0 and on the fp32 partitions at
    ZeRO-1/2/3; an instance attribute holds the arguments for that call and is removed after it.
    """
    if not kwargs:
        yield
        return
    before = vars(optimizer).get("step")
    optimizer.step = functools.partial(optimizer.step, **kwargs)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if before is None:
            del optimizer.step
        else:
            optimizer.step = before  # type: ignore[method-assign]


class EngineScheduler:
    """What ``self.lr_schedulers()`` returns for the scheduler of an engine's DeepSpeed ``scheduler`` section.

    In manual optimization that engine steps it in ``opt.step()``; a second ``sch.step()`` from the
    user would advance it twice per step, so it raises instead. Everything else (``get_last_lr()``,
    ``state_dict()``, ``optimizer``) reads the real scheduler. Schedulers from ``configure_optimizers``
    are not wrapped: the user steps them.

    Args:
        name: the engine's name.
        scheduler: the scheduler DeepSpeed built from the engine's config.
    """

    def __init__(self, name: str, scheduler: Any) -> None:
        self.name = name
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Refuse: ``opt.step()`` of this engine already stepped the scheduler."""
        raise ValueError(
            f"The learning-rate scheduler of engine {self.name!r} is stepped by its optimizer: `opt.step()` "
            "runs DeepSpeed's `engine.step()`, which steps the optimizer and then the scheduler. Remove the "
            "`lr_scheduler.step()` call from your LightningModule."
        )

    def __getattr__(self, item: str) -> Any:
        return getattr(self.__dict__["scheduler"], item)

    def __repr__(self) -> str:
        return f"EngineScheduler(engine={self.name!r}, scheduler={type(self.scheduler).__name__})"
