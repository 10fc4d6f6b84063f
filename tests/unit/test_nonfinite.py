"""The stage-0 fp32 non-finite check: a step whose gradients hold a NaN or inf updates nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_multids._compat import torch as torch_compat
from lightning_multids._nonfinite import NonFiniteGradients, skip_nonfinite_steps


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_step_with_a_nonfinite_gradient_is_refused_before_it_updates(bad: float) -> None:
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    handle = skip_nonfinite_steps(SimpleNamespace(optimizer=optimizer, fp16_enabled=lambda: False))  # type: ignore[arg-type]
    assert handle is not None
    for param in params[:2]:
        param.grad = torch.full((4,), 1e20)  # large but finite, its square past fp32's range: applied
    optimizer.step()
    assert params[0].data.eq(1 - 1e19).all()

    params[2].grad = torch.tensor([-0.0, bad, 1e-45, 3.0])  # -0 and a subnormal: kept bit for bit by the check
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    with pytest.raises(NonFiniteGradients), torch.autograd.set_detect_anomaly(True):  # Trainer(detect_anomaly=True)
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(torch.equal(p.grad.view(torch.int32), g.view(torch.int32)) for p, g in zip(params, grads, strict=True))
    handle.remove()


def test_without_anomaly_mode_a_nonfinite_step_is_applied_as_under_ddp_and_nothing_is_read() -> None:
    """The default step reads no flag (a host-device sync on a GPU): a NaN gradient is applied, as DDP applies it."""
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    handle = skip_nonfinite_steps(SimpleNamespace(optimizer=optimizer, fp16_enabled=lambda: False))  # type: ignore[arg-type]
    assert handle is not None
    param.grad = torch.tensor([float("nan"), 1.0])
    optimizer.step()
    assert param.data[0].isnan() and param.data[1] == 0.9
    handle.remove()


@pytest.mark.parametrize(
    ("count", "size", "value", "dtype"),
    [
        (10, 4, 1e4, torch.float16),  # each norm 2e4; their sum 2e5, past fp16's 65504
        (1, 2, 5e4, torch.float16),  # one norm of 7.1e4, past fp16's range, of finite elements
    ],
)
def test_finite_low_precision_gradients_whose_norms_leave_their_range_are_applied(
    count: int, size: int, value: float, dtype: torch.dtype
) -> None:
    """Every element is finite, so the step is applied, however large the norms are in the gradients' dtype."""
    params = [torch.nn.Parameter(torch.zeros(size, dtype=dtype)) for _ in range(count)]
    optimizer = torch.optim.SGD(params, lr=1e-4)
    handle = skip_nonfinite_steps(SimpleNamespace(optimizer=optimizer, fp16_enabled=lambda: False))  # type: ignore[arg-type]
    assert handle is not None
    for param in params:
        param.grad = torch.full((size,), value, dtype=dtype)
    optimizer.step()
    assert all((param != 0).all() for param in params)
    handle.remove()


@pytest.mark.parametrize("fused", [True, False])  # False: the way for bf16 on CUDA, where the fused check has no kernel
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_the_check_finds_a_nonfinite_value_in_any_dtype_with_either_way(
    fused: bool, bad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_compat, "_fused_check_runs_on", lambda device, dtype: fused)
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.float16).t()]
    if bad is not None:
        tensors[1][1] = bad
    assert torch_compat._any_nonfinite_by_group(tensors) is (bad is not None)
    assert torch_compat.any_nonfinite(tensors) is (bad is not None)  # on the CPU: one call of the fused check


def test_the_check_runs_whatever_the_default_dtype() -> None:
    torch.set_default_dtype(torch.float64)
    try:
        assert torch_compat.any_nonfinite([torch.tensor([1.0, float("inf")], dtype=torch.float32)])
        assert not torch_compat.any_nonfinite([torch.ones(3, dtype=torch.float32)])
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_nan_beside_a_tensor_on_another_device_is_never_answered_finite() -> None:
    """One call takes the CPU's kernel only when every tensor is on the CPU: a meta tensor's kernel checks nothing."""
    tensors = [torch.tensor([float("nan")]), torch.ones(2, device="meta")]
    with pytest.raises(RuntimeError, match="meta"):  # the meta tensor has no value to read: refused, not "finite"
        torch_compat.any_nonfinite(tensors)
    assert torch_compat.any_nonfinite([torch.tensor([float("nan")]), torch.ones(2, dtype=torch.float64)])
