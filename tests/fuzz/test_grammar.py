"""The fuzzer's own parts, in one process: generation, JSON, shrinking edits, the reference and the classifier."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.fuzz import fuzz, grammar, launch, outcome, program, reference
from tests.fuzz.grammar import Call, Case, Engine, Phase, Term


def gan_case() -> Case:
    """D called twice (real, fake.detach()), then G's loss through D: the README's GAN."""
    d_phase = Phase(
        [Term([Call("g"), Call("d", detach=True)]), Term([Call("d")], source="y")], owner="d", zero_grad="before"
    )
    g_phase = Phase([Term([Call("g"), Call("d")], target="half")], owner="g", toggle=True)
    return Case(0, [Engine("d", stage=2), Engine("g", stage=3, optimizer="adam")], [d_phase, g_phase])


def test_a_seed_gives_the_same_case_and_json_round_trips() -> None:
    for seed in range(20):
        case = grammar.generate(seed, valid=reference.resolve)
        assert grammar.to_json(case) == grammar.to_json(grammar.generate(seed, valid=reference.resolve))
        assert grammar.to_json(grammar.from_json(grammar.to_json(case))) == grammar.to_json(case)


def test_safe_switches_leave_out_the_known_defects() -> None:
    for seed in range(60):
        assert not set(fuzz.suspects(grammar.generate(seed, grammar.SAFE, valid=reference.resolve))), seed


def test_resolve_steps_only_engines_with_gradients_on_every_rank() -> None:
    resolved = reference.resolve(gan_case())
    assert resolved is not None
    assert [phase.steps for phase in resolved.phases] == [["d"], ["g"]]
    frozen = copy.deepcopy(gan_case())
    frozen.engine("g").optimizer = None
    frozen.phases = frozen.phases[:1]
    resolved = reference.resolve(frozen)
    assert resolved is not None and resolved.phases[0].steps == ["d"]


def test_resolve_refuses_a_backward_that_reaches_no_trained_engine() -> None:
    case = gan_case()
    case.phases[1].terms = [Term([Call("g", no_grad=True), Call("d", detach=True)], penalty=False)]
    case.phases[1].toggle = True  # toggled to g: d's parameters need no gradient, g ran under no_grad
    assert reference.resolve(case) is None


def test_every_simplification_is_one_edit_smaller_and_valid_json() -> None:
    case = grammar.generate(5, valid=reference.resolve)
    seen = set()
    for description, simpler in grammar.simplifications(case):
        text = grammar.to_json(simpler)
        assert text != grammar.to_json(case), description
        assert grammar.to_json(grammar.from_json(text)) == text
        seen.add(description.split(":")[0].split("[")[0])
    assert any(name.startswith("drop phases") or name.startswith("drop") for name in seen)


def expected(case: Case) -> reference.Result:
    resolved = reference.resolve(case)
    assert resolved is not None
    return reference.reference(resolved)


def as_ranks(result: reference.Result) -> list[dict]:
    reads = [read.to_dict() for read in result.reads]
    return [{"weights": result.weights, "reads": reads, "seconds": 0.0} for _ in range(2)]


def test_the_comparison_flags_a_gradient_off_by_a_factor() -> None:
    """A term weighted twice in the run being checked (a gradient counted twice) is a mismatch, at fp32 and bf16."""
    case = gan_case()
    case.read_before_step = True
    right = expected(case)
    doubled = copy.deepcopy(case)
    doubled.phases[1].terms[0].weight = 2.0
    wrong = as_ranks(expected(doubled))
    assert outcome.compare(reference.resolve(case), right, as_ranks(right)).kind == "match"  # type: ignore[arg-type]
    for precision in ("32-true", "bf16-mixed"):
        case.precision = precision
        result = outcome.compare(case, right, wrong)
        assert result.kind == "mismatch" and result.worst > 1.0, result


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_mismatch_says_how_far_rounding_alone_moves_plain_pytorch(precision: str) -> None:
    """The note: plain PyTorch with bf16 weights, or from weights one ulp away, against the reference."""
    case = reference.resolve(gan_case())
    assert case is not None
    case.read_before_step, case.precision = True, precision
    right = expected(case)
    doubled = copy.deepcopy(case)
    doubled.phases[1].terms[0].weight = 2.0
    noise, how = reference.rounding_noise(case)
    ways = {"32-true": "from initial weights one ulp away", "bf16-mixed": "with bf16 weights"}
    assert how == f"plain PyTorch {ways[precision]}"
    assert any(not torch.equal(noise.weights[key], right.weights[key]) for key in right.weights)
    floor = outcome.compare(case, right, as_ranks(noise)).worst  # rounding alone: within the tolerance here
    found = outcome.with_rounding_noise(
        outcome.compare(case, right, as_ranks(expected(doubled))), case, right, noise, how
    )
    assert 0.0 < floor <= 1.0 and found.kind == "mismatch"
    assert f" ({how}: {floor:.2f} of the tolerance, at " in found.detail, found.detail
    matched = outcome.compare(case, right, as_ranks(right))
    assert outcome.with_rounding_noise(copy.deepcopy(matched), case, right, noise, how) == matched


def test_the_comparison_flags_a_missing_hook_read() -> None:
    case = gan_case()
    case.read_before_step = True
    right = expected(case)
    ranks = as_ranks(right)
    ranks[1]["reads"] = ranks[1]["reads"][:-1]
    result = outcome.compare(case, right, ranks)
    assert result.kind == "mismatch" and result.detail.startswith("reads:")


def record(error_type: str, message: str, innermost: str) -> dict:
    return {"type": error_type, "message": message, "frames": ["/x/tests/fuzz/program.py:1:f", innermost]}


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (
            record(
                "ValueError",
                "`opt.step()` of engine 'g' was called with no gradient since its last step or `zero_grad()`: ...",
                "/x/lightning_multids/_optimizer.py:190:_refuse_empty_step",
            ),
            "documented",
        ),
        (
            record(  # a message built by a function of the package (`raise RuntimeError(self._refusal(...))`)
                "RuntimeError",
                "`opt.state[param]` of engine 'e1': DeepSpeed keeps this optimizer's state in its own flat fp32 "
                "partitions, not in torch's per-parameter form. ...",
                "/x/lightning_multids/_optimizer.py:68:_check",
            ),
            "documented",
        ),
        (record("KeyError", "0", "/x/deepspeed/runtime/zero/stage_1_and_2.py:1:f"), "undocumented"),
        (record("AssertionError", "", "/x/lightning_multids/_compat/deepspeed.py:1:f"), "undocumented"),
    ],
)
def test_errors_are_documented_only_when_the_strategy_raised_its_own_message(error: dict, kind: str) -> None:
    other_rank = record("RuntimeError", "[../gloo/transport/tcp/pair.cc:538] Connection closed by peer", "x:1:f")
    result = outcome.from_errors([other_rank, error], timed_out=False)
    assert result.kind == kind
    assert outcome.from_errors([error], timed_out=True).kind == "hang"


def test_signatures_come_from_the_strategys_raise_statements() -> None:
    found = outcome.signatures()
    assert any("was called with no gradient since its last step" in s for s in found)
    assert any("reaches no trainable engine" in s for s in found)
    assert any("DeepSpeed keeps this optimizer's state" in s for s in found)  # returned by `_no_torch_state`
    assert any("over flat partitions of the engine's parameters" in s for s in found)  # `_tensorwise_refusal`
    assert all(len(s) >= 20 for s in found)


def test_the_reference_reproduces_a_term_that_differs_per_rank() -> None:
    """A ``data`` gate open on one rank only: the reference averages that rank's gradient with none (DDP)."""
    case = gan_case()
    case.phases = case.phases[:1]
    case.phases[0].terms.append(Term([Call("d")], gate="data"))
    gated = expected(case)
    case.phases[0].terms[-1].gate = "always"
    assert any(not torch.equal(gated.weights[k], v) for k, v in expected(case).weights.items())


def test_the_average_is_removed_only_when_no_call_runs_it() -> None:
    """Shrinking seed 1321 (a term calls the EMA average) crashed the driver: removing the average left the call."""
    case = grammar.generate(1321, grammar.FULL, valid=reference.resolve)
    assert case.ema is not None and case.ema.average in {
        c.engine for p in case.phases for t in p.terms for c in t.calls
    }
    for description, simpler in grammar.simplifications(case):
        assert simpler.ema is not None or description != "case: ema=None"


def test_a_case_written_before_a_field_existed_loads_with_its_default() -> None:
    data = grammar.to_dict(gan_case())
    for engine in data["engines"]:
        del engine["joins"], engine["built_frozen"], engine["unfreeze_at"]
    for phase in data["phases"]:
        del phase["drop_grad"], phase["reset_state"]
    del data["set_to_none"], data["part_entries"]
    assert grammar.to_json(grammar.from_dict(data)) == grammar.to_json(gan_case())


def joined_case() -> Case:
    """One SGD over ``g`` and ``d`` (``d`` joins ``g``'s optimizer): one engine named ``g``, at ZeRO-0."""
    case = gan_case()
    case.engines = [Engine("g", stage=0), Engine("d", stage=0, joins="g")]
    case.phases = case.phases[1:]
    return case


def test_an_optimizer_over_two_submodules_is_one_optimizer_named_by_the_first() -> None:
    case = joined_case()
    assert case.trained == ["g"] and case.parts("g") == ["g", "d"]
    resolved = reference.resolve(case)
    assert resolved is not None and resolved.phases[0].steps == ["g"]
    trained = expected(case)
    assert all(not torch.equal(trained.weights[k], v) for k, v in reference.weights(program.make_modules(case)).items())
    case.engine("d").stage = 2  # a part at another stage than its engine's: not a valid case
    assert reference.resolve(case) is None


def built_frozen(case: Case, unfrozen: bool, stage: int = 0) -> None:
    """``d``'s first layer built frozen (and unfrozen at the second step), the engine at ``stage``."""
    for engine in case.engines:
        engine.stage = stage
    case.engine("d").built_frozen = True
    case.engine("d").unfreeze_at = 1 if unfrozen else None


def reset_state(case: Case, precision: str) -> None:
    case.phases[0].reset_state, case.precision = True, precision


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda c: None, None),
        (lambda c: setattr(c, "part_entries", True), "`engine_configs` has an entry for"),
        (lambda c: setattr(c.phases[0], "drop_grad", True), r"`param\.grad` of a parameter of engine"),
        (lambda c: reset_state(c, "32-true"), None),  # torch's own optimizer state at ZeRO-0 in fp32
        (lambda c: reset_state(c, "bf16-mixed"), r"`opt\.state\[param\]`"),
        (lambda c: built_frozen(c, unfrozen=True), None),  # ZeRO-0 in fp32: its torch optimizer holds the layer
        (lambda c: built_frozen(c, unfrozen=False, stage=2), None),
        (lambda c: built_frozen(c, unfrozen=True, stage=2), "had `requires_grad=False` when the engine was built"),
    ],
)
def test_the_reference_expects_the_documented_refusals(change: Callable[[Case], object], pattern: str | None) -> None:
    """docs/errors.md: what the strategy refuses of the per-parameter touches, and where it trains."""
    case = joined_case()
    change(case)
    refused = reference.refusal(case)
    assert (refused is None) if pattern is None else (refused is not None and pattern in refused), refused


def test_a_rank_error_record_cut_short_is_no_record(tmp_path: Path) -> None:
    """A rank ended while writing its record (another rank failed first) left an empty file: the driver crashed."""
    (tmp_path / "cut.json").write_text("")
    (tmp_path / "whole.json").write_text('{"type": "ValueError", "message": "m", "frames": []}')
    assert launch.read_record(tmp_path / "cut.json") is None
    assert launch.read_record(tmp_path / "missing.json") is None
    assert launch.read_record(tmp_path / "whole.json") == {"type": "ValueError", "message": "m", "frames": []}
