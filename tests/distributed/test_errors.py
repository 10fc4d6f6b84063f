"""Bad input fails in a real 2-rank fit with a message that names the engine, the setting and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests import patterns
from tests.distributed.harness import run_ranks

EXPECTED = {
    "no_optimizer": r"configure_optimizers` returned None, so no engine would train.*one optimizer per submodule",
    "spanning_optimizer": r"Optimizer 0 holds parameters of .generator. and .discriminator.*one optimizer per",
    "unknown_engine_key": r"entry for 'critic'.*no submodule of that name",
    "optimizer_in_both": r"engine .discriminator. gets an optimizer from `configure_optimizers` and its DeepSpeed",
    "fp16_on_cpu": r"engine 'generator' enables fp16, which DeepSpeed does not run on a CPU.*bf16-mixed",
    "clip_on_frozen": r"engine 'discriminator' has no optimizer.*`gradient_clipping` setting would do nothing",
    "returned_loss_in_manual": r"returned a loss but called no `self.manual_backward`.*'generator', 'discriminator'",
    "detached_loss": r"reaches no trainable engine",
    "returned_loss_in_user_manual": r"^no error$",  # Lightning allows it: the returned loss is detached
    "accumulate_when_switched": r"accumulate_grad_batches=2\)`: `GAN` has 2 trainable engines.*manual_backward\(loss",
    "scheduler_stepped_by_user": r"scheduler of engine 'discriminator' is stepped by its optimizer",
    "forced_automatic": r"2 trainable engines but keeps `automatic_optimization` True.*remove the",
    "batch_contradiction": r"engine 'generator' sets train_micro_batch_size_per_gpu=16.*gives 4 samples per process",
    "engine_called_directly": r"engine .generator. was called directly. Call the submodule instead \(`self.gen",
    "optimizer_state_dict_zero3": r"`opt.state_dict\(\)` of engine 'generator'.*flat fp32 partitions.*"
    r"trainer.save_checkpoint\(path\)`.*`deepspeed.utils.safe_get_full_optimizer_state\(param, \"exp_avg\"\)`",
    "optimizer_state_dict_zero0_bf16": r"`opt.state_dict\(\)` of engine 'generator'.*beside fp32 copies.*"
    r"trainer.save_checkpoint\(path\)` and `trainer.fit\(model, ckpt_path=path\)`, which write and read every "
    r"engine's part.$",  # no per-parameter helper: DeepSpeed's return nothing at ZeRO-0
    "optimizer_state_dict_zero0": r"^no error$",
    "optimizer_load_state_dict": r"`opt.load_state_dict\(...\)` of engine 'discriminator'.*ckpt_path=path.*"
    r"safe_set_full_optimizer_state\(param, value, \"exp_avg\"\)",
    "step_without_backward": r"`opt.step\(\)` of engine 'generator' was called with no gradient.*manual_backward",
    "zero_grad_before_step": r"engine 'generator' was called with no gradient since its last step or `zero_grad\(\)`",
    "offload_with_torch_optimizer": r"engine 'generator' offloads its optimizer states .*`torch.optim.sgd.SGD`.*"
    r"DeepSpeedCPUAdam\(self.generator.parameters\(\), ...\).*zero_force_ds_cpu_optimizer",
    "gathered_differs_by_rank": r"`strategy.gathered\('(generator|discriminator)'\)`: rank\(s\) \[[01]\] "
    r"entered another block at the same time. Every rank must enter the same `gathered` blocks in the same order.",
    "frozen_without_parameters": r"submodule 'head' has an `engine_configs` entry and no optimizer.*no parameters.*"
    r"Remove its entry",
    **{
        f"shared_frozen{p}_trained{d}": r"engines 'discriminator' and 'probe' share a parameter.*frozen one turns "
        r"their gradients off.*If 'probe' only reuses the layer, remove its `engine_configs` entry"
        for p, d in [(0, 2), (3, 3), (3, 2), (2, 0)]
    },
    "shared_plain_trained3": r"plain submodule 'probe' shares a parameter with the ZeRO-3 engine 'discriminator'.*"
    r"copy that does not train. Give 'discriminator' ZeRO-0/1/2",
    **{f"shared_plain_trained{d}": r"^no error$" for d in (0, 2)},
    "ema_of_another_shape": r"EMA engine 'discriminator' cannot average 'generator': their parameters differ.*deepcopy",
    "ema_that_is_trained": r"EMA engine 'generator' \(`ema=`\) has an optimizer.*stop returning an optimizer over",
    **{
        f"plain_backward_zero{stage}": r"backward outside `self.manual_backward` reached the parameters of engine "
        r"'discriminator'.*replace the call with `self.manual_backward\(loss\)`"
        for stage in range(4)
    },
    "autograd_backward": r"outside `self.manual_backward` reached the parameters of engine '(generator|discriminator)'",
    "autograd_grad_allowed": r"^no error$",
    "uneven_reach_zero3": r"The loss reaches the ZeRO-3 engine 'discriminator' on some ranks and not on others.*"
    r"`loss \+ 0.0 \* term`.*ZeRO-0/1/2 for 'discriminator'",
    "penalty_through_zero3": r"partitioned ZeRO-3 weight.*gradient penalty.*ZeRO-3 engine \(discriminator, generator\)"
    r".*Give the engines the penalty runs through ZeRO-0/1/2",
    **{  # at ZeRO-3 the block's exception path then clears whole local gradients (ZeRO-3's zero_grad failed on them)
        f"full_gradients_in_no_sync_zero{stage}": rf"`full_gradients\('discriminator'\)` inside `strategy.no_sync"
        rf"\(...\)`: the ZeRO-{stage} engine .*Read them after the `with` block"
        for stage in (2, 3)
    },
}


@pytest.fixture(scope="module")
def weights_after_nan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nan")


@pytest.fixture(scope="module")
def results(weights_after_nan: Path) -> dict[int, dict[str, str]]:
    outputs = run_ranks(Path(__file__).with_name("run_errors.py"), str(weights_after_nan), timeout=300)
    parsed = {}
    for rank, out in enumerate(outputs):
        parsed[rank] = dict(re.findall(r"^RESULT (\w+): (.*)$", out, flags=re.M))
    return parsed


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_scenario_raises_a_clear_error_on_every_rank(results: dict[int, dict[str, str]], scenario: str) -> None:
    for rank, messages in results.items():
        assert scenario in messages, f"rank {rank} did not run {scenario}"
        assert re.search(EXPECTED[scenario], messages[scenario]), f"rank {rank}: {messages[scenario]}"


NAN_RUNS = ["zero0", "zero1", "zero2", "zero3", "zero0_bf16", "zero2_bf16_unchecked", "zero1_unnormed"]


@pytest.mark.parametrize("run", NAN_RUNS)
def test_nan_gradient_in_one_engine_is_reported_and_changes_no_weights(
    results: dict[int, dict[str, str]], weights_after_nan: Path, run: str
) -> None:
    """Rank 1 feeds a NaN to the discriminator at its second step: both ranks refuse that step."""
    for rank, messages in results.items():
        assert f"nan_{run}" in messages, f"rank {rank} raised no FloatingPointError"
        assert re.search(r"engine 'discriminator' is NaN or infinite at its step 2", messages[f"nan_{run}"]), rank
    # The refused step is the first of the second batch: the weights are those the batch started with.
    weights = torch.load(weights_after_nan / f"{run}.pt")
    for key, value in weights["before"].items():
        assert torch.equal(weights["after"][key], value), key
        assert torch.isfinite(value).all(), key


def test_nan_refused_step_follows_one_good_step_of_plain_pytorch(
    results: dict[int, dict[str, str]], weights_after_nan: Path
) -> None:
    """After the refused step, the fp32 ZeRO-2 run holds the weights of one good GAN step of plain PyTorch."""
    expected = patterns.reference("gan_zero_first", "sgd", 1)
    weights = torch.load(weights_after_nan / "zero2.pt")["after"]
    for key, value in expected.items():
        assert torch.allclose(weights[key], value, atol=1e-5), key
