"""Edits of a ZeRO-0 bf16/fp16 engine's weights reach DeepSpeed's ``FP16_Optimizer`` master copy at the step.

DeepSpeed gives a ZeRO-0 engine in bf16 or fp16 whose optimizer is its own ``FusedAdam`` (a config's ``optimizer``
section on CUDA) an ``FP16_Optimizer``: it steps a flat fp32 master copy and copies it into the module's weights, so
an edit between steps (``gathered(name, modifier_rank=r)``, ``load_state_dict``, a clamp) would be overwritten.
FusedAdam needs CUDA, so the optimizer here is DeepSpeed's class with the attributes its constructor makes
(``fp16_groups``, ``fp32_groups_flat``), over weights that are views of one flat 16-bit tensor, as there.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_multids._compat import deepspeed as ds_compat


def fused_fp16_optimizer(dtype: torch.dtype) -> tuple[FP16_Optimizer, list[torch.nn.Parameter]]:
    master = [torch.tensor([[0.1001, -0.3], [0.7, 2.0]]), torch.tensor([1.0001, -1.5, 0.25])]
    weights = [torch.nn.Parameter(value.to(dtype)) for value in master]
    flat = _flatten_dense_tensors(weights)
    for weight, view in zip(weights, _unflatten_dense_tensors(flat, weights), strict=True):
        weight.data = view  # as FP16_Optimizer makes them
    optimizer = FP16_Optimizer.__new__(FP16_Optimizer)
    optimizer.fp16_groups, optimizer.fp16_groups_flat = [weights], [flat]
    optimizer.fp32_groups_flat = [_flatten_dense_tensors(master)]
    return optimizer, weights


def test_an_edit_reaches_the_master_copy_and_unedited_weights_keep_their_fp32_precision() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        optimizer, (edited, kept) = fused_fp16_optimizer(dtype)
        before = optimizer.fp32_groups_flat[0].clone()
        edited.data.clamp_(-0.25, 0.25)  # WGAN's clamp
        ds_compat.take_weight_edits(SimpleNamespace(optimizer=optimizer))  # type: ignore[arg-type]
        master = _unflatten_dense_tensors(optimizer.fp32_groups_flat[0], [edited, kept])
        expected = torch.tensor([[0.1001, -0.25], [0.25, 0.25]])  # 0.1001, which the clamp kept, keeps its precision
        torch.testing.assert_close(master[0], expected, rtol=0, atol=0)
        torch.testing.assert_close(master[1], before[4:], rtol=0, atol=0)  # 1.0001 is not bf16/fp16's 1.0
