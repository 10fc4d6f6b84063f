import json
from pathlib import Path

import pytest

from lightning_multids import MultiDeepSpeedStrategy
from lightning_multids._config import (
    DEEPSPEED_REDUCE_BUCKET,
    DEEPSPEED_ZERO3,
    FROZEN_ZERO3,
    apply_precision,
    check_accumulation_dtype,
    engine_config,
    frozen_config,
    load_config,
    merge,
    precision_section,
    sized_buckets,
    validate_stage,
    zero3_init_config,
)


def test_merge_recurses_and_leaves_inputs_alone() -> None:
    base = {"zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {"enabled": False}}
    override = {"zero_optimization": {"stage": 3}}
    merged = merge(base, override)
    assert merged == {"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": False}}
    assert base["zero_optimization"]["stage"] == 2


def test_engine_config_layers_default_then_override() -> None:
    config = engine_config(
        "discriminator",
        stage=1,
        default={"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5},
        override={"zero_optimization": {"stage": 3}},
        precision="bf16-mixed",
    )
    assert config["zero_optimization"]["stage"] == 3
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True}
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_accumulation_steps"] == 1


def test_engine_config_does_not_clip_by_default() -> None:
    # DeepSpeed's own default is 1.0, which would silently diverge from PyTorch.
    assert engine_config("g", stage=2, default={}, override={})["gradient_clipping"] == 0.0


def test_load_config_reads_json(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert load_config(str(path), what="x") == {"zero_optimization": {"stage": 3}}


def test_missing_config_file_names_engine_and_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"engine 'discriminator'.*not a file.*existing JSON file"):
        MultiDeepSpeedStrategy(engine_configs={"discriminator": str(tmp_path / "missing.json")})


def test_config_that_is_not_json_names_engine_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{stage: 3")
    with pytest.raises(ValueError, match=r"engine 'generator'.*not valid JSON.*Fix the file"):
        MultiDeepSpeedStrategy(engine_configs={"generator": str(path)})


def test_config_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"every engine.*holds a list.*JSON object"):
        MultiDeepSpeedStrategy(config=str(path))


@pytest.mark.parametrize("stage", [-1, 4, "2", True, None])
def test_stage_outside_0_3_is_refused(stage: object) -> None:
    with pytest.raises(ValueError, match=r"ZeRO stage of MultiDeepSpeedStrategy\(stage=...\).*0, 1, 2 and 3"):
        MultiDeepSpeedStrategy(stage=stage)  # type: ignore[arg-type]


def test_stage_outside_0_3_in_an_engine_config_names_the_engine() -> None:
    with pytest.raises(ValueError, match=r"ZeRO stage of the engine 'critic' is 5"):
        engine_config("critic", stage=2, default={}, override={"zero_optimization": {"stage": 5}})


def test_validate_stage_accepts_each_stage() -> None:
    assert [validate_stage(s, what="x") for s in (0, 1, 2, 3)] == [0, 1, 2, 3]


def test_accumulation_in_deepspeed_config_is_refused_with_the_lightning_fix() -> None:
    with pytest.raises(ValueError, match=r"engine 'generator'.*gradient_accumulation_steps=4.*accumulate_grad_batches"):
        engine_config("generator", stage=2, default={"gradient_accumulation_steps": 4}, override={})


@pytest.mark.parametrize(
    ("section", "accumulated", "weights"),
    [("bf16", "fp32", "bf16"), ("bfloat16", "fp32", "bf16"), (None, "bf16", "fp32")],
)
def test_an_accumulation_dtype_zero0_cannot_run_is_refused_with_the_engine(
    section: str | None, accumulated: str, weights: str
) -> None:
    """DeepSpeed would raise ``NotImplementedError("unsupported mix ...")`` from ``deepspeed.initialize``."""
    config = {"zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": accumulated}}
    config |= {section: {"enabled": True}} if section else {}
    refused = rf"engine 'student' sets `data_types.grad_accum_dtype: '{accumulated}'` with {weights} weights at ZeRO-0"
    with pytest.raises(ValueError, match=rf"{refused}.*ZeRO-1 or higher"):
        check_accumulation_dtype(config, "the engine 'student'")
    for stage in (1, 2, 3):  # what ZeRO runs passes, as do the weights' own dtype and no section
        check_accumulation_dtype({**config, "zero_optimization": {"stage": stage}}, "the engine 'student'")
    check_accumulation_dtype({**config, "data_types": {"grad_accum_dtype": weights}}, "the engine 'student'")
    check_accumulation_dtype({**config, "data_types": None}, "the engine 'student'")


def test_unsupported_precision_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"precision='64-true'.*'bf16-mixed'"):
        precision_section("64-true")


def test_trainer_precision_is_mapped_unless_the_engine_chooses() -> None:
    assert apply_precision({}, "bf16-mixed", what="x")["bf16"] == {"enabled": True}
    assert apply_precision({}, "32-true", what="x") == {}
    # an fp32 engine (e.g. a frozen reward model) beside bf16 ones
    assert apply_precision({"bf16": {"enabled": False}}, "bf16-mixed", what="x") == {"bf16": {"enabled": False}}
    # a bf16 engine under an fp32 Trainer
    assert apply_precision({"bf16": {"enabled": True}}, "32-true", what="x") == {"bf16": {"enabled": True}}


def test_precision_conflicting_with_the_trainer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*asks for bf16.*the engine 'teacher' enables fp16"):
        engine_config("teacher", stage=3, default={}, override={"fp16": {"enabled": True}}, precision="bf16-mixed")


def test_config_enabling_bf16_and_fp16_is_refused() -> None:
    with pytest.raises(ValueError, match=r"engine 'student' enables both bf16 and fp16"):
        engine_config("student", stage=2, default={"bf16": {"enabled": True}}, override={"fp16": {"enabled": True}})


def test_fp16_on_cpu_is_refused_and_allowed_on_cuda() -> None:
    override = {"fp16": {"enabled": True}}
    with pytest.raises(ValueError, match=r"engine 'generator' enables fp16.*not run on a CPU"):
        engine_config("generator", stage=2, default={}, override=override, device_type="cpu")
    assert engine_config("generator", stage=2, default={}, override=override, device_type="cuda")["fp16"]["enabled"]


def test_micro_batch_size_from_the_loader_unless_the_config_sets_it() -> None:
    assert (
        engine_config("g", stage=2, default={}, override={}, micro_batch_size=16)["train_micro_batch_size_per_gpu"]
        == 16
    )
    own = {"train_micro_batch_size_per_gpu": 4}
    assert (
        engine_config("g", stage=2, default={}, override=own, micro_batch_size=16)["train_micro_batch_size_per_gpu"]
        == 4
    )


def test_frozen_engine_runs_stage_1_and_2_replicated_and_keeps_3() -> None:
    for stage, expected in ((0, 0), (1, 0), (2, 0), (3, 3)):
        config = engine_config("teacher", stage=stage, default={}, override={})
        assert frozen_config("teacher", config, {})["zero_optimization"]["stage"] == expected


def test_frozen_zero3_engine_gets_lean_defaults_and_the_users_settings_win() -> None:
    lean = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    config = engine_config("teacher", stage=3, default={}, override={})
    assert lean.items() <= frozen_config("teacher", config, {})["zero_optimization"].items()
    # Either of DeepSpeed's two names for a setting, in the strategy's default config or the engine's entry.
    default = {"zero_optimization": {"stage3_max_live_parameters": 10**8}}
    override = {"zero_optimization": {"prefetch_bucket_size": 10**6}}
    config = engine_config("teacher", stage=3, default=default, override=override)
    zero = frozen_config("teacher", config, override)["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == 10**8 and zero["prefetch_bucket_size"] == 10**6
    assert "stage3_prefetch_bucket_size" not in zero and zero["stage3_max_reuse_distance"] == 0
    for stage in (0, 1, 2):  # nothing is partitioned: nothing to add
        config = engine_config("teacher", stage=stage, default={}, override={})
        assert not lean.keys() & frozen_config("teacher", config, {})["zero_optimization"].keys()
    trained = engine_config("student", stage=3, default={}, override={})  # a trained engine keeps DeepSpeed's
    assert not lean.keys() & trained["zero_optimization"].keys()


def test_deepspeeds_defaults_written_here_are_deepspeeds() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = DeepSpeedZeroConfig()
    assert DEEPSPEED_ZERO3.keys() == {key for key, _ in FROZEN_ZERO3}
    for key, alias in FROZEN_ZERO3:
        assert DEEPSPEED_ZERO3[key] == getattr(defaults, alias)
    assert defaults.reduce_bucket_size == DEEPSPEED_REDUCE_BUCKET


def test_a_trained_engines_reduce_bucket_is_no_larger_than_its_gradients() -> None:
    for stage in (1, 2, 3):
        config = engine_config("student", stage=stage, default={}, override={})
        assert sized_buckets(config, 4160)["zero_optimization"]["reduce_bucket_size"] == 4160
        assert sized_buckets(config, 10**10)["zero_optimization"]["reduce_bucket_size"] == DEEPSPEED_REDUCE_BUCKET
        assert "reduce_bucket_size" not in config["zero_optimization"], "the input config must not change"
    own = engine_config("student", stage=2, default={}, override={"zero_optimization": {"reduce_bucket_size": 7}})
    assert sized_buckets(own, 4160)["zero_optimization"]["reduce_bucket_size"] == 7
    stage0 = engine_config("student", stage=0, default={}, override={})
    assert "reduce_bucket_size" not in sized_buckets(stage0, 4160)["zero_optimization"]


@pytest.mark.parametrize("key", ["gradient_clipping", "scheduler"])
def test_frozen_engine_refuses_settings_that_need_an_optimizer(key: str) -> None:
    override = {key: 1.0 if key == "gradient_clipping" else {"type": "WarmupLR"}}
    config = engine_config("teacher", stage=3, default={}, override=override)
    with pytest.raises(ValueError, match=rf"engine 'teacher' has no optimizer.*`{key}` setting would do nothing"):
        frozen_config("teacher", config, override)


def test_zero3_init_config_resolves_each_engine_stage_and_takes_the_zero3_one() -> None:
    assert zero3_init_config(2, {}, {"a": {}}, "32-true") is None
    teacher = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    config = zero3_init_config(2, {}, {"teacher": teacher, "student": {}}, "32-true")
    assert config is not None and config["bf16"]["enabled"] and config["zero_optimization"]["stage"] == 3
    from_config = zero3_init_config(2, {"zero_optimization": {"stage": 3}}, {}, "32-true")
    assert from_config is not None and from_config["zero_optimization"]["stage"] == 3


def test_zero3_engines_that_disagree_on_what_zero_init_reads_are_refused() -> None:
    overrides = {
        "teacher": {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
        "reward": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
    }
    with pytest.raises(ValueError, match=r"the engine 'teacher' sets `bf16.enabled` to True and the engine 'reward'"):
        zero3_init_config(2, {}, overrides, "32-true")
    overrides["reward"]["bf16"] = {"enabled": True}
    with pytest.raises(
        ValueError, match=r"`zero_optimization.offload_param`.*build the ones that differ in `__init__`"
    ):
        zero3_init_config(2, {}, overrides, "32-true")


def test_zero3_engines_that_agree_are_not_held_to_the_default() -> None:
    """Every ZeRO-3 entry offloads; the default does not, but may serve no submodule at all."""
    offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    config = zero3_init_config(3, {}, {"actor": offload, "ref": offload}, "32-true")
    assert config is not None and config["zero_optimization"]["offload_param"] == {"device": "cpu"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zero_optimization": 3}, r"'g' sets `zero_optimization` to 3.*write `zero_optimization: \{\"stage\": 3\}`"),
        ({"bf16": True}, r"sets `bf16` to True.*`bf16: \{\"enabled\": true\}`"),
        ({"optimizer": "Adam"}, r"sets `optimizer` to 'Adam'.*`optimizer: \{\"type\""),
        (
            {"zero_optimization": {"stage": 3, "offload_param": "cpu"}},
            r"sets `zero_optimization.offload_param` to 'cpu'.*`offload_param: \{\"device\": \"cpu\"\}`",
        ),
    ],
)
def test_a_section_that_is_not_an_object_names_it_and_how_to_write_it(
    config: dict, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(config, what="the engine 'g'")
    (tmp_path / "g.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'g' in '.*g.json' sets"):
        load_config(tmp_path / "g.json", what="the engine 'g'")


def test_an_offload_set_to_null_is_accepted() -> None:
    assert load_config({"zero_optimization": {"offload_param": None}}, what="x") == {
        "zero_optimization": {"offload_param": None}
    }


@pytest.mark.parametrize("source", [[1, 2], 3, {"a"}])
def test_a_config_that_is_neither_a_dict_nor_a_path_names_its_type(source: object) -> None:
    with pytest.raises(ValueError, match=rf"for the engine 'g' is a {type(source).__name__} .*Pass a dict"):
        load_config(source, what="the engine 'g'")  # type: ignore[arg-type]
