"""What happens to a step whose reduced gradients hold a NaN or inf: it is applied by no rank."""

from __future__ import annotations

from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from torch.utils.hooks import RemovableHandle

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.torch import any_nonfinite


class NonFiniteGradients(FloatingPointError):
    """Raised in ``engine.step()`` when the reduced gradients hold a NaN or inf (:func:`skip_nonfinite_steps`)."""


def skip_nonfinite_steps(engine: DeepSpeedEngine) -> RemovableHandle | None:
    """Make ``engine.step()`` apply no update, on every rank alike, when its reduced gradients hold a NaN or inf.

    The check runs on the gradients after the reduction, where every rank sees the same verdict, so it
    costs no collective of its own. DeepSpeed's optimizers check already, or are made to
    (:func:`~lightning_multids._compat.deepspeed.ensure_nonfinite_check`), and skip the step (``engine.skipped_steps``
    grows). A plain torch optimizer (stage 0, fp32) checks nothing, as under ``DDPStrategy``: the step is applied,
    NaN and all, unless ``Trainer(detect_anomaly=True)`` (torch's anomaly mode) is on. A step pre-hook on it then
    raises :class:`NonFiniteGradients` before it updates anything (the reduced gradients are the same on every rank
    at stage 0, so every rank raises); its handle is returned, for teardown. The check reads a flag, a host-device
    sync on a GPU, so the default step does not make it.
    """
    if ds_compat.ensure_nonfinite_check(engine) or not isinstance(engine.optimizer, torch.optim.Optimizer):
        return None
    return engine.optimizer.register_step_pre_hook(_refuse_nonfinite)


def _refuse_nonfinite(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # GradScaler's fused check, values left as they are, and one read (a device sync on a GPU): the same read that
    # DeepSpeed's own check makes at bf16 stage 0 (the overflow check of `FP16_Optimizer` over bf16 weights). Only
    # under anomaly mode, where the user asked for checks that cost time.
    if not torch.is_anomaly_enabled():
        return
    grads = [grad for group in optimizer.param_groups for p in group["params"] if (grad := p.grad) is not None]
    if grads and any_nonfinite(grads):
        raise NonFiniteGradients
