"""A fixed slice of the fuzzer in the suite: 14 seeds, one 2-rank launch (about 40 s), all must match.

``SLICE`` draws with ``grammar.SAFE`` (the dimensions of the six defects known on 2026-11-24 left out); its seeds
cover between them ZeRO 0-3 (mixed in one module), frozen engines, SGD and Adam, bf16, chains through several
engines, detach and no_grad, toggling, accumulation over micro-batches, every ``zero_grad`` placement,
``no_sync``, a gradient penalty, activation checkpointing, ``on_before_optimizer_step`` reading
``full_gradients``, and an EMA engine. ``FIXES`` draws with ``grammar.FULL``: seeds that exercise the six
defects' dimensions and pass since their fixes (``on_after_backward`` reads, ``offload_optimizer``, the bf16
optimizer's fp32 accumulation, a term on some ranks only, a reentrant checkpoint beside a plain call).
``test_the_slice_covers`` keeps them covering that. ``RESUMES`` draws with ``grammar.SAFE_RESUMING``: layers
shared by two engines (refused at setup), and resumes with a ZeRO stage changed (ZeRO-1 <-> ZeRO-2 resumes, others
are refused at load), a save inside ``gathered``, the EMA or a frozen engine dropped. ``TOUCHES`` draws with
``grammar.SAFE_TOUCHING``: ``self.clip_gradients`` before a step (also read before it) and weight edits after a
phase, plain and inside ``gathered(name, modifier_rank=0)`` (at ZeRO-3 too), in bf16, before a resume and on the
source of an EMA. ``OPTIM`` draws with ``grammar.BEFORE_PER_PARAMETER``: 0-dim parameters, layers frozen mid-fit,
``self.<engine>.zero_grad()`` at ZeRO-2/3, AdamW's decay and Adafactor at ZeRO-0; ``PER_PARAMETER``, in the same
launch, with ``grammar.SAFE_OPTIM``: one optimizer over two submodules (at ZeRO-0, 2 and 3, in bf16 too), a layer
built frozen at ZeRO-3, unfrozen at ZeRO-0 (refused elsewhere, so not here), a layer frozen for the first step only
at ZeRO-2, ``zero_grad(set_to_none=False)`` and Adam's moments reset through ``opt.state[p]`` at ZeRO-0.
``make fuzz`` runs the whole grammar over a range of seeds.
"""

from __future__ import annotations

import re

import pytest

from tests.fuzz import grammar, launch, reference
from tests.fuzz.grammar import Case, Phase

SLICE = (30, 25, 7, 31, 0, 38, 12)  # seeds of grammar.SAFE; `test_the_slice_covers` says what they must cover
TIMEOUT = 150.0


FIXES = (108, 264, 156, 292, 214, 164, 55)  # seeds of grammar.FULL


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    safe = [grammar.generate(seed, grammar.SAFE, valid=reference.resolve) for seed in SLICE]
    return safe + [grammar.generate(seed, grammar.BEFORE_RESUME, valid=reference.resolve) for seed in FIXES]


def features(case: Case) -> set[str]:
    found = {f"stage{engine.stage}" for engine in case.engines}
    found |= {str(engine.optimizer) if engine.trained else "frozen" for engine in case.engines}
    found |= {f"inner_{engine.inner_checkpoint}" for engine in case.engines if engine.inner_checkpoint}
    found |= {name for engine in case.engines for name in ("offload", "fp32_grad_accum") if getattr(engine, name)}
    flags = {"bf16": case.precision == "bf16-mixed", "ema": case.ema is not None}
    flags |= {"read_before_step": case.read_before_step, "read_after_backward": bool(case.read_after_backward)}
    for phase in case.phases:
        found |= {f"zero_grad_{phase.zero_grad}"} | term_features(phase)
        flags |= {"toggle": flags.get("toggle") or phase.toggle, "micro": flags.get("micro") or phase.micro > 1}
        flags["no_sync"] = flags.get("no_sync") or phase.no_sync != "off"
    return found | {name for name, present in flags.items() if present}


def term_features(phase: Phase) -> set[str]:
    found = set()
    for term in phase.terms:
        found |= {"chain"} if len({call.engine for call in term.calls}) > 1 else set()
        found |= {"penalty"} if term.penalty else set()
        found |= {name for call in term.calls for name in ("detach", "no_grad") if getattr(call, name)}
        found |= {f"call_{call.checkpoint}" for call in term.calls if call.checkpoint}
        found |= {"gate_data"} if term.gate == "data" else set()
    return found


COVERED = {"stage0", "stage1", "stage2", "stage3", "frozen", "sgd", "adam", "bf16", "ema", "read_before_step"}
COVERED |= {"zero_grad_before", "zero_grad_after", "zero_grad_between", "zero_grad_none", "toggle", "micro"}
COVERED |= {"no_sync", "chain", "penalty", "detach", "no_grad"}
COVERED |= {"offload", "fp32_grad_accum", "gate_data", "call_reentrant", "read_after_backward"}


def test_the_slice_covers(cases: list[Case]) -> None:
    found = set().union(*(features(case) for case in cases))
    assert found >= COVERED, f"the slice no longer covers {sorted(COVERED - found)}: choose other seeds"


RESUMES = (1130, 45, 129, 235, 250, 274)  # seeds of grammar.SAFE_RESUMING; the refused ones first (see below)


@pytest.fixture(scope="module")
def resumes() -> list[Case]:
    return [grammar.generate(seed, grammar.SAFE_RESUMING, valid=reference.resolve) for seed in RESUMES]


def resume_features(case: Case) -> set[str]:
    found = {"shared_frozen"} if any(e.shares and not e.trained for e in case.engines) else set()
    resume = case.resume
    if resume is None:
        return found
    changed = {(case.engine(name).stage, stage) for name, stage in resume.stages.items() if case.engine(name).trained}
    found |= {"stage_refused"} if reference.refusal(case) else set()
    found |= {"stage_1_2"} if changed & {(1, 2), (2, 1)} and not reference.refusal(case) else set()
    flags = {"inside": resume.inside is not None, "drop_ema": resume.drop_ema, "drop_frozen": bool(resume.drop_frozen)}
    return found | {name for name, present in flags.items() if present}


def test_the_resume_slice_covers(resumes: list[Case]) -> None:
    found = set().union(*(resume_features(case) for case in resumes))
    wanted = {"shared_frozen", "stage_refused", "stage_1_2", "inside", "drop_ema", "drop_frozen"}
    assert found >= wanted, f"the resume slice no longer covers {sorted(wanted - found)}: choose other seeds"


def test_shared_layers_and_resumes_train_as_plain_pytorch_or_are_refused(resumes: list[Case]) -> None:
    """A refused case ends its launch; first in the list, each is confirmed without a second launch of its own."""
    results = launch.run_cases(resumes, TIMEOUT, batch=len(resumes))
    failed = []
    for case, result in zip(resumes, results, strict=True):
        refused = reference.refusal(case)
        ok = (
            result.kind == "match"
            if refused is None
            else result.kind == "documented" and re.search(refused, result.detail)
        )
        if not ok:
            failed.append(f"seed {case.seed}: {result.kind} {result.detail} (expected {refused or 'a match'})")
    assert not failed, "\n".join(failed)


def assert_all_match(cases: list[Case]) -> None:
    """Train ``cases`` in one 2-rank launch; each must match plain PyTorch (else its JSON is shown)."""
    results = launch.run_cases(cases, TIMEOUT, batch=len(cases))
    failed = [
        f"seed {case.seed}: {result.kind} {result.error_type} {result.detail}\n{grammar.to_json(case)}"
        for case, result in zip(cases, results, strict=True)
        if result.kind != "match"
    ]
    assert not failed, "\n".join(failed)


def test_the_slice_matches_plain_pytorch(cases: list[Case]) -> None:
    assert_all_match(cases)


TOUCHES = (0, 1, 3, 6, 8, 10, 52)  # seeds of grammar.SAFE_TOUCHING (52: in-place edits between ZeRO-2 steps)


@pytest.fixture(scope="module")
def touches() -> list[Case]:
    return [grammar.generate(seed, grammar.SAFE_TOUCHING, valid=reference.resolve) for seed in TOUCHES]


def touch_features(case: Case) -> set[str]:
    found = set()
    for phase in case.phases:
        found |= {"clip"} if phase.clip else set()
        found |= {"clip_read"} if phase.clip and case.read_before_step else set()
        if phase.edit != "none":
            found |= {f"edit_{phase.edit}", f"edit_{phase.edit}_stage{case.engine(phase.owner).stage}"}
            found |= {"bf16_edit"} if case.precision == "bf16-mixed" else set()
            found |= {"resume_edit"} if case.resume is not None else set()
            found |= {"ema_edit"} if case.ema is not None and case.ema.source == phase.owner else set()
    return found


def test_the_touch_slice_covers(touches: list[Case]) -> None:
    found = set().union(*(touch_features(case) for case in touches))
    wanted = {"clip", "clip_read", "edit_plain_stage1", "edit_plain_stage2", "edit_block_stage3", "bf16_edit"}
    wanted |= {"resume_edit", "ema_edit", "edit_inplace"}
    assert found >= wanted, f"the touch slice no longer covers {sorted(wanted - found)}: choose other seeds"


def test_clipping_and_weight_edits_train_as_plain_pytorch(touches: list[Case]) -> None:
    assert_all_match(touches)


OPTIM = (78, 18, 35, 2, 14)  # seeds of grammar.BEFORE_PER_PARAMETER (grammar.SAFE_OPTIM when they were chosen)
PER_PARAMETER = (432, 20, 327, 35)  # seeds of grammar.SAFE_OPTIM


@pytest.fixture(scope="module")
def optims() -> list[Case]:
    before = [grammar.generate(seed, grammar.BEFORE_PER_PARAMETER, valid=reference.resolve) for seed in OPTIM]
    return before + [grammar.generate(seed, grammar.SAFE_OPTIM, valid=reference.resolve) for seed in PER_PARAMETER]


def optim_features(case: Case) -> set[str]:
    found = (
        {"module_zero_grad_zero23"}
        if case.zero_grad_by == "module" and any(e.stage > 1 for e in case.engines)
        else set()
    )
    for engine in case.engines:
        found |= {f"scalar_stage{engine.stage}"} if engine.scalar else set()
        found |= (
            {f"freeze_stage{engine.stage}"} if engine.freeze_at is not None and engine.unfreeze_at is None else set()
        )
        found |= {f"{engine.optimizer}_stage{engine.stage}"} if engine.optimizer in ("adamw", "adafactor") else set()
        found |= {f"joined_stage{engine.stage}"} if engine.joins else set()
        found |= {"joined_bf16"} if engine.joins and case.precision == "bf16-mixed" else set()
        built = "built_frozen" if engine.unfreeze_at is None else "unfreeze_built"
        found |= {f"{built}_stage{engine.stage}"} if engine.built_frozen else set()
        unfrozen = engine.unfreeze_at is not None and not engine.built_frozen
        found |= {f"unfreeze_stage{engine.stage}"} if unfrozen else set()
    found |= {"set_to_none_false"} if not case.set_to_none else set()
    owners = [case.engine(phase.owner) for phase in case.phases if phase.reset_state]
    return found | {f"reset_{owner.optimizer}_stage{owner.stage}" for owner in owners}


def test_the_optim_slice_covers(optims: list[Case]) -> None:
    found = set().union(*(optim_features(case) for case in optims))
    wanted = {"scalar_stage0", "scalar_stage3", "freeze_stage1", "freeze_stage2", "module_zero_grad_zero23"}
    wanted |= {"adamw_stage1", "adamw_stage2", "adafactor_stage0"}
    wanted |= {"joined_stage0", "joined_stage2", "joined_stage3", "joined_bf16", "built_frozen_stage3"}
    wanted |= {"unfreeze_built_stage0", "unfreeze_stage2", "set_to_none_false", "reset_adam_stage0"}
    assert found >= wanted, f"the optim slice no longer covers {sorted(wanted - found)}: choose other seeds"


def test_what_torch_optim_does_per_parameter_trains_as_plain_pytorch(optims: list[Case]) -> None:
    assert_all_match(optims)
