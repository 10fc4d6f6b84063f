"""Lightning's and DeepSpeed's conventions: the supported DeepSpeed, step hooks, checkpoint IO, logging, renames."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.deepspeed import UnsupportedDeepSpeed
from lightning_multids._optimizer import EngineOptimizer
from lightning_multids._record import EngineRecord

REPO = Path(__file__).resolve().parents[2]


def test_a_deepspeed_outside_the_supported_range_is_refused() -> None:
    for version in ("0.20.0", "0.19.7", "0.18.3"):
        with pytest.raises(UnsupportedDeepSpeed, match=rf">=0.19.8,<0.20; this is DeepSpeed {version}.*pip install"):
            ds_compat.check_deepspeed(version)
    ds_compat.check_deepspeed("0.19.9+cu121")  # a local build of a supported release
    ds_compat.check_deepspeed()  # the installed one


def test_setup_refuses_an_unsupported_deepspeed_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deepspeed.__version__", "0.20.1")
    with pytest.raises(UnsupportedDeepSpeed, match="this is DeepSpeed 0.20.1"):
        MultiDeepSpeedStrategy().setup_distributed()


def test_a_deepspeed_without_a_method_used_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DeepSpeedEngine, "_backward_prologue")
    with pytest.raises(UnsupportedDeepSpeed, match=r"`DeepSpeedEngine._backward_prologue`.*>=0.19.8,<0.20"):
        ds_compat.check_deepspeed()


def test_an_engine_without_an_attribute_used_is_refused() -> None:
    engine = SimpleNamespace(**dict.fromkeys(ds_compat._ENGINE_ATTRIBUTES), optimizer=None)
    ds_compat.check_engine("generator", engine)  # type: ignore[arg-type]
    del engine.inside_no_sync_ctxt
    with pytest.raises(UnsupportedDeepSpeed, match=r"`DeepSpeedEngine.inside_no_sync_ctxt` \(engine 'generator'\)"):
        ds_compat.check_engine("generator", engine)  # type: ignore[arg-type]
    engine.inside_no_sync_ctxt = False
    engine.optimizer = object.__new__(DeepSpeedZeroOptimizer)  # none of its instance attributes
    with pytest.raises(UnsupportedDeepSpeed, match=r"`DeepSpeedZeroOptimizer.ipg_buckets` \(engine 'generator'\)"):
        ds_compat.check_engine("generator", engine)  # type: ignore[arg-type]


def test_without_deepspeed_the_import_says_how_to_install_it() -> None:
    code = "import sys; sys.modules['deepspeed'] = None; import lightning_multids"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode != 0
    assert "lightning_multids needs DeepSpeed" in result.stderr
    assert "pip install 'deepspeed>=0.19.8,<0.20'" in result.stderr


def _fake_engine_optimizer(calls: list[str]) -> EngineOptimizer:
    module = nn.Linear(2, 2)
    engine = SimpleNamespace(
        module=module,
        optimizer=None,
        fp16_enabled=lambda: False,
        global_steps=0,
        skipped_steps=0,
        step=lambda: calls.append("engine.step"),
        zero_grad=lambda: None,
    )
    record = EngineRecord("generator", engine, trainable=True)  # type: ignore[arg-type]
    optimizer = EngineOptimizer(record, torch.optim.SGD(module.parameters()), [list(module.parameters())])
    record.has_gradients = True
    return optimizer


def test_optimizer_step_hooks_run_around_each_engine_step() -> None:
    """Hooks on ``self.optimizers()`` (a LightningOptimizer), on the optimizer itself and torch's global ones."""
    calls: list[str] = []
    optimizer = _fake_engine_optimizer(calls)
    LightningOptimizer(optimizer).register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    handle = register_optimizer_step_pre_hook(lambda *_: calls.append("global pre"))
    try:
        optimizer.step()
    finally:
        handle.remove()
    assert calls == ["global pre", "pre", "engine.step", "post"]


def test_a_step_without_hooks_or_profiler_skips_torchs_hook_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner opens a profiler region on every call (host time on each step); it is needed only for hooks."""
    regions: list[str] = []
    record_function = torch.autograd.profiler.record_function

    def spy(name: str, *args: object) -> object:
        regions.append(name)
        return record_function(name, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", spy)
    calls: list[str] = []
    optimizer = _fake_engine_optimizer(calls)
    optimizer.step()
    assert calls == ["engine.step"] and regions == []

    handle = optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    optimizer.record.has_gradients = True
    optimizer.step()
    handle.remove()
    assert calls == ["engine.step", "engine.step", "post"] and regions == ["Optimizer.step#EngineOptimizer.step"]


def test_a_post_hook_registered_during_the_step_runs_after_it() -> None:
    """torch's runner reads the post hooks after the step body, so one registered in the closure runs; so here."""
    calls: list[str] = []
    optimizer = _fake_engine_optimizer(calls)
    handles = []

    def closure() -> None:
        calls.append("closure")
        handles.append(optimizer.register_step_post_hook(lambda *_: calls.append("post")))

    optimizer.manual = False
    optimizer.step(closure)
    handles[0].remove()
    assert calls == ["closure", "engine.step", "post"]


def test_a_step_under_the_profiler_is_recorded_as_a_torch_optimizers() -> None:
    optimizer = _fake_engine_optimizer([])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        optimizer.step()
    assert "Optimizer.step#EngineOptimizer.step" in {event.name for event in profiler.events()}


def test_a_checkpoint_io_is_refused() -> None:
    with pytest.raises(ValueError, match=r"checkpoint_io=TorchCheckpointIO\(...\)`.*Remove the `checkpoint_io`"):
        MultiDeepSpeedStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(ValueError, match=r"the CheckpointIO from `Trainer\(plugins=...\)`"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=MultiDeepSpeedStrategy(), plugins=[TorchCheckpointIO()])


def test_an_unknown_checkpoint_format_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"checkpoint_format='files'\): choose 'directory' \(the default.*or 'file'"):
        MultiDeepSpeedStrategy(checkpoint_format="files")  # type: ignore[arg-type]


def test_a_failure_is_logged_with_its_rank(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="lightning_multids"):
        MultiDeepSpeedStrategy().on_exception(RuntimeError("Connection closed by peer"))
    assert "[rank 0] MultiDeepSpeedStrategy: RuntimeError: Connection closed by peer" in caplog.text
    assert "another rank stopped" in caplog.text


@pytest.mark.parametrize(
    ("error", "peer"),
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"), True),
        (torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error"), True),
        (RuntimeError("[enforce fail at ../gloo/allreduce.cc] mismatched sizes in a gloo all_reduce"), False),
        (torch.distributed.DistBackendError("NCCL error: invalid usage"), False),
        (torch.distributed.DistNetworkError("The server socket has failed to listen: EADDRINUSE"), False),
        (RuntimeError("write to the log: Broken pipe"), False),
        (ValueError("Connection closed by peer"), False),
    ],
)
def test_only_a_lost_peer_is_reported_as_another_rank_failing(error: BaseException, peer: bool) -> None:
    """No type tells a lost peer (``DistError`` also covers misuse and a port in use): the words of a lost peer do."""
    MultiDeepSpeedStrategy().on_exception(error)
    assert error.lightning_multids_peer_failed is peer  # type: ignore[attr-defined]
