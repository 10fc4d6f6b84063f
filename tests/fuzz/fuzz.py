"""The differential fuzzer's driver: run seeds, classify, group the failures, shrink one of each group.

    python -m tests.fuzz.fuzz --seeds 0:200 --report outputs/fuzz/report.json
    python -m tests.fuzz.fuzz shrink --seed 17          # or --case FILE.json: print the smallest failing case
    python -m tests.fuzz.fuzz shrink --from-report outputs/fuzz/report.jsonl   # one case of each failure group
    python -m tests.fuzz.fuzz summarize outputs/fuzz/report.jsonl             # counts and groups, also mid-run

Each seed's case (:func:`grammar.generate`) is trained on 2 CPU ranks under the strategy and in plain
PyTorch (``reference.py``), and classified (``outcome.py``). Failures are grouped by their signature (class,
and for an error its type and where it was raised); one case of each group is shrunk: simplified one
dimension at a time while the signature stays, the smallest printed as JSON (keep it in
``tests/fuzz/regressions/``). The report (JSON) lists every case, the counts per class and the shrunk cases,
and each line of ``REPORT.jsonl`` is written as soon as its case has run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fuzz import grammar, launch, reference
from tests.fuzz.grammar import Case
from tests.fuzz.outcome import KINDS, Outcome

SWITCHES = {"full": grammar.FULL, "safe": grammar.SAFE, "safe_resuming": grammar.SAFE_RESUMING}
SWITCHES["safe_touching"] = grammar.SAFE_TOUCHING
SWITCHES["safe_optim"] = grammar.SAFE_OPTIM
SWITCHES["before_per_parameter"] = grammar.BEFORE_PER_PARAMETER

KNOWN_DEFECTS: dict[int, tuple[str, Callable[[Case], bool]]] = {
    1: ("on_after_backward reads full_gradients before the epilogues", lambda c: bool(c.read_after_backward)),
    2: (
        "ZeRO-2 + offload_optimizer: zero_grad() keeps CPU-accumulated gradients",
        lambda c: any(e.offload and e.stage == 2 for e in c.engines),
    ),
    3: (
        "full_gradients under BF16_Optimizer sees the last micro-backward only",
        lambda c: c.precision == "bf16-mixed" and any(e.fp32_grad_accum for e in c.engines),
    ),
    4: (
        "a loss that reaches an engine on some ranks only",
        lambda c: any(t.gate == "data" for p in c.phases for t in p.terms),
    ),
    5: ("loss.backward() beside manual_backward at ZeRO-2/3", lambda c: any(p.plain_backward for p in c.phases)),
    6: (
        "an engine called plainly and inside a reentrant checkpoint at ZeRO-2/3",
        lambda c: any(call.checkpoint == "reentrant" for p in c.phases for t in p.terms for call in t.calls),
    ),
    7: (
        "a plain submodule beside bf16 engines gets their bf16 outputs and fails (no autocast, unlike DDP)",
        lambda c: (
            c.precision == "bf16-mixed" and c.resume is not None and (c.resume.drop_ema or bool(c.resume.drop_frozen))
        ),
    ),
}
"""The defects known, each with the feature of a case that can show it (a hint, not a proof): 1-6 on 2026-11-24, 7
found by the resume grammar on 2026-11-25."""


def _uneven_at_zero3(case: Case) -> bool:
    stages = {engine.name: engine.stage for engine in case.engines} | (
        {case.ema.average: case.ema.stage} if case.ema else {}
    )
    gated = [term for phase in case.phases for term in phase.terms if term.gate == "data"]
    return any(stages[call.engine] == 3 for term in gated for call in term.calls)


LIMITATIONS: dict[str, Callable[[Case], bool]] = {
    "README Limitations: a loss reaching an engine on some ranks only is not supported at ZeRO-3": _uneven_at_zero3,
    "README: a plain loss.backward() reaching an engine is refused": lambda c: any(p.plain_backward for p in c.phases),
}
"""What the README documents as unsupported or refused, with the feature of a case that runs into it (a hint)."""


def limits(case: Case) -> list[str]:
    """The documented limitations whose feature ``case`` has."""
    return [text for text, has in LIMITATIONS.items() if has(case)]


def suspects(case: Case) -> list[int]:
    """The known defects whose feature ``case`` has."""
    return [number for number, (_, has) in KNOWN_DEFECTS.items() if has(case)]


def size(case: Case) -> int:
    """How big a case is: its phases, terms, calls and engines (a failure's smallest case is shrunk first)."""
    calls = sum(len(term.calls) for phase in case.phases for term in phase.terms)
    return len(case.engines) + len(case.phases) + calls + sum(len(phase.terms) for phase in case.phases)


# ---- shrinking -------------------------------------------------------------------------------------------


@dataclass
class Shrunk:
    case: Case
    outcome: Outcome
    steps: list[str]
    launches: int


def shrink(case: Case, signature: tuple[str, ...], timeout: float, batch: int, launches: int) -> Shrunk:
    """Simplify ``case`` greedily (:func:`grammar.simplifications`, biggest first) while its outcome keeps
    ``signature``, within ``launches`` 2-rank launches; then run the result alone."""
    budget = launch.Budget(launches)
    batch = 1 if signature[0] == "hang" else batch  # each hang costs a launch's whole timeout
    steps: list[str] = []
    start = 0  # the edits before it kept nothing in this pass: try them again in the next pass only
    while budget.left > 0:
        candidates = [
            (description, resolved)
            for description, simpler in grammar.simplifications(case)
            if (resolved := reference.resolve(simpler)) is not None
        ]
        found = launch.first_with(signature, [c for _, c in candidates[start:]], timeout, batch, budget)
        if found is None:
            if start == 0 or budget.left <= 0:
                break
            start = 0
            continue
        start += found
        steps.append(candidates[start][0])
        case = candidates[start][1]
        print(f"  shrink: {steps[-1]} (size {size(case)})", flush=True)
    final = launch.run_batch([case], timeout)[0]
    return Shrunk(case, final, steps, launches - budget.left + 1)


# ---- running seeds ---------------------------------------------------------------------------------------


def parse_seeds(text: str) -> range:
    start, _, stop = text.partition(":")
    return range(int(start), int(stop)) if stop else range(int(start), int(start) + 1)


def as_expected(case: Case, result: Outcome) -> bool:
    """Whether ``result`` is what ``reference.refusal`` expects: a match, or the documented refusal it names."""
    refused = reference.refusal(case)
    if refused is None:
        return result.kind == "match"
    return result.kind == "documented" and re.search(refused, result.detail) is not None


def case_line(case: Case, result: Outcome) -> dict[str, Any]:
    line = {
        "seed": case.seed,
        **result.to_dict(),
        "suspects": suspects(case),
        "limits": limits(case),
        "size": size(case),
        "expected": reference.refusal(case),
        "as_expected": as_expected(case, result),
    }
    line["case"] = grammar.to_dict(case)
    return line


def run_seeds(seeds: range, args: argparse.Namespace, log: Path) -> list[dict[str, Any]]:
    """Run every seed's case, ``args.batch`` per launch; append each line to ``log`` as it comes."""
    switches = SWITCHES[args.switches]
    lines: list[dict[str, Any]] = []
    for start in range(0, len(seeds), args.batch):
        cases = [
            grammar.generate(seed, switches, valid=reference.resolve) for seed in seeds[start : start + args.batch]
        ]
        for case, result in zip(cases, launch.run_cases(cases, args.timeout, args.batch), strict=True):
            lines.append(case_line(case, result))
            with log.open("a") as out:
                out.write(json.dumps(lines[-1]) + "\n")
            print(f"seed {case.seed}: {result.kind} {result.error_type} {result.detail[:160]}", flush=True)
    return lines


def groups_of(lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The failures by signature (class, error type, where), smallest case first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if line["kind"] != "match":
            key = " | ".join(Outcome(**{k: line[k] for k in Outcome.__dataclass_fields__ if k in line}).signature())
            groups.setdefault(key, []).append(line)
    return {key: sorted(members, key=lambda line: line["size"]) for key, members in groups.items()}


def kept_entry(result: Shrunk, seeds: list[int]) -> dict[str, Any]:
    """A shrunk case as ``tests/fuzz/regressions/*.json`` keeps it (fill in ``note``; ``known_defect`` is a guess)."""
    found = result.outcome
    likely = suspects(result.case)
    return {
        "case": grammar.to_dict(result.case),
        "found": f"{found.kind}: {found.error_type} {found.detail}".strip(),
        "signature": " | ".join(found.signature()),
        "known_defect": likely[0] if len(likely) == 1 else None,
        "limits": limits(result.case),
        "note": "",
        "seeds": seeds,
        "shrink_steps": result.steps,
        "launches": result.launches,
    }


def shrink_groups(groups: dict[str, list[dict[str, Any]]], args: argparse.Namespace, folder: Path) -> list[dict]:
    """Shrink the smallest case of each group; write each result to ``folder/<n>.json``, ready to keep."""
    folder.mkdir(parents=True, exist_ok=True)
    kept = []
    for number, (key, members) in enumerate(groups.items()):
        first = members[0]
        print(f"shrinking seed {first['seed']} ({key})", flush=True)
        signature = tuple(key.split(" | "))
        result = shrink(grammar.from_dict(first["case"]), signature, args.timeout, args.shrink_batch, args.shrink)
        kept.append({"group": key, **kept_entry(result, [line["seed"] for line in members])})
        (folder / f"{number}.json").write_text(json.dumps(kept[-1], indent=1))
        print(grammar.to_json(result.case), flush=True)
    return kept


def summary(lines: list[dict[str, Any]], shrunk: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    counts = {kind: sum(line["kind"] == kind for line in lines) for kind in KINDS}
    return {"cases": len(lines), "counts": counts, "seconds": round(seconds), "shrunk": shrunk}


def fuzz(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    log = report.with_suffix(".jsonl")
    log.write_text("")
    lines = run_seeds(parse_seeds(args.seeds), args, log)
    shrunk = shrink_groups(groups_of(lines), args, report.parent / f"{report.stem}-shrunk") if args.shrink else []
    result = {"seeds": args.seeds, "switches": args.switches, **summary(lines, shrunk, time.perf_counter() - start)}
    report.write_text(json.dumps({**result, "lines": lines}, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "shrunk"}))
    return result


def read_lines(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(args: argparse.Namespace) -> None:
    """``summarize R.jsonl``: the counts per class and the failure groups of a run (finished or interrupted)."""
    lines = read_lines(args.jsonl)
    counts = {kind: sum(line["kind"] == kind for line in lines) for kind in KINDS}
    seeds = sorted(line["seed"] for line in lines)
    print(json.dumps({"cases": len(lines), "seeds": f"{seeds[0]}..{seeds[-1]}" if seeds else "", "counts": counts}))
    unexpected = [
        line for line in lines if line.get("as_expected") is False and line["kind"] in ("match", "documented")
    ]
    if unexpected:  # a refusal where reference.refusal expects none, another one, or a match where it expects one
        print(f"not as reference.refusal expects: seeds {[line['seed'] for line in unexpected]}")
    for key, members in sorted(groups_of(lines).items(), key=lambda item: -len(item[1])):
        print(f"{len(members):4d}  {key}: {members[0]['detail'][:120]}")
        print(f"      seeds {[line['seed'] for line in members]}")
        if key.startswith("documented"):
            print(f"      refused as reference.refusal expects: {[m['seed'] for m in members if m.get('as_expected')]}")
        print(f"      known-defect features {sorted({d for line in members for d in line['suspects']})}")
        print(f"      documented limitations {sorted({t for line in members for t in limits(_case(line))})}")


def _case(line: dict[str, Any]) -> Case:
    return grammar.from_dict(line["case"])


def shrink_report(args: argparse.Namespace) -> None:
    """``shrink --from-report R.jsonl [--only TEXT]``: shrink one case of each failure group of a run's report."""
    lines = read_lines(args.from_report)
    groups = {key: members for key, members in groups_of(lines).items() if not args.only or args.only in key}
    folder = Path(args.from_report).with_suffix("")
    shrink_groups(groups, args, folder.parent / f"{folder.name}-shrunk")


def shrink_one(args: argparse.Namespace) -> None:
    """``shrink --seed N`` or ``shrink --case FILE``: run it, and shrink it if it fails."""
    if args.from_report:
        shrink_report(args)
        return
    if args.case:
        data = json.loads(Path(args.case).read_text())
        case = grammar.from_dict(data.get("case", data))  # a case, or a kept entry holding one
    else:
        case = grammar.generate(args.seed, SWITCHES[args.switches], valid=reference.resolve)
    first = launch.run_batch([case], args.timeout)[0]
    print(f"seed {case.seed}: {first.kind} {first.error_type} {first.detail}", flush=True)
    if first.kind == "match":
        return
    result = shrink(case, first.signature(), args.timeout, args.shrink_batch, args.shrink or 25)
    print(json.dumps(kept_entry(result, [case.seed]), indent=1))


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--timeout", type=float, default=120.0, help="seconds for a launch of one case")
    common.add_argument("--batch", type=int, default=8, help="cases per 2-rank launch")
    common.add_argument("--switches", choices=sorted(SWITCHES), default="full")
    common.add_argument("--shrink", type=int, default=20, help="launches to shrink each group's case (0: none)")
    common.add_argument("--shrink-batch", type=int, default=16, help="candidate cases per launch when shrinking")
    main = argparse.ArgumentParser(description=__doc__, parents=[common])
    main.add_argument("--seeds", default="0:20", help="A:B, the seeds A to B-1")
    main.add_argument("--report", default="outputs/fuzz/report.json")
    commands = main.add_subparsers(dest="command")
    one = commands.add_parser("shrink", parents=[common], help="run one case and shrink it if it fails")
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--case", help="a case's JSON file instead of a seed")
    one.add_argument("--from-report", help="a run's REPORT.jsonl: shrink one case of each failure group")
    one.add_argument("--only", help="with --from-report: the groups whose signature contains this text")
    summary_command = commands.add_parser("summarize", help="counts and failure groups of a run's REPORT.jsonl")
    summary_command.add_argument("jsonl")
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "shrink":
        shrink_one(args)
        return 0
    if args.command == "summarize":
        summarize(args)
        return 0
    fuzz(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
