"""The language-model distillation over several seeds and both held-out splits: does the teacher help the student?

Runs the commands of docs/language-models.md (``lightning-multids fit --config configs/lm_distill_teacher.yaml``,
then ``configs/lm_distill.yaml``) once per split for the teacher (seed 0) and once per split and seed for the two
students, each in its own folder under ``--out`` (``configs`` linked there, so the configs' relative paths hold),
and prints, per split, the held-out perplexity of the distilled student and of its control (``alone``: the same
start and batches, no teacher) as mean and range over the seeds, with each seed's difference. Every run's figures
go to ``OUT/results.json``; a run whose folder already holds its figures for the same arguments is not run again
(for other arguments, or after a change of a config, give another ``--out``).

Usage: ``python benchmarks/lm_grid.py [--splits files names] [--seeds 0 1 2] [--teacher-epochs N]
[--student-epochs N] [--out outputs/lm-grid] [-- ARGS]``, where ARGS are passed to every student run
(``--model.init_args.alpha=0.5``, say); without the epoch options each run trains as long as its config says.
``make lm-grid`` runs it with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = re.compile(r"Held-out perplexity: (?P<figures>.*) \(per byte\)")


def run(folder: Path, config: str, args: list[str], after: list[str] | None = None) -> dict[str, float]:
    """Run ``lightning-multids fit --config configs/CONFIG ARGS`` in ``folder``; the held-out perplexities it prints.

    Figures saved for the same ``args`` (and the same ``after``: the arguments of the run it builds on) stand.
    """
    done = folder / "figures.json"
    key = [*args, *(["after:", *after] if after else [])]
    if done.exists():
        cached = json.loads(done.read_text())
        if cached.pop("args", None) == key:  # the same run: its figures stand (else it runs again, afresh)
            return cached
        shutil.rmtree(folder / "outputs", ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "configs").exists():
        (folder / "configs").symlink_to(ROOT / "configs")
    command = [sys.executable, "-m", "lightning_multids.cli", "fit", "--config", f"configs/{config}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, check=False)
    (folder / "output.txt").write_text(result.stdout + result.stderr)
    match = FIGURES.search(result.stdout)
    if result.returncode != 0 or match is None:
        raise SystemExit(f"{' '.join(command)} failed in {folder} (exit {result.returncode}): see output.txt there")
    parts = [part.split() for part in match["figures"].split(", ")]  # "6.875", or "teacher 6.9, student 8.8, ..."
    figures = {part[0] if len(part) == 2 else "perplexity": float(part[-1]) for part in parts}
    figures["seconds"] = round(time.monotonic() - start)
    done.write_text(json.dumps({**figures, "args": key}))
    return figures


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", nargs="+", default=["files", "names"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "lm-grid")
    parser.add_argument("--teacher-epochs", type=int, help="the teacher's max_epochs (default: its config's)")
    parser.add_argument("--student-epochs", type=int, help="the students' max_epochs (default: their config's)")
    parser.add_argument("student_args", nargs="*", help="after --: passed to every student run")
    args = parser.parse_args()
    out = args.out.resolve()
    results: dict[str, dict] = {}
    for split in args.splits:
        data = [f"--data.init_args.split={split}"]
        epochs = [f"--trainer.max_epochs={args.teacher_epochs}"] if args.teacher_epochs else []
        teacher_args = [*data, *epochs]
        teacher = run(out / split / "teacher", "lm_distill_teacher.yaml", teacher_args)
        checkpoint = out / split / "teacher" / "outputs" / "lm" / "teacher" / "checkpoints" / "teacher.ckpt"
        students = {}
        for seed in args.seeds:
            student_args = [*data, f"--seed_everything={seed}", f"--model.init_args.teacher_checkpoint={checkpoint}"]
            student_args += [f"--trainer.max_epochs={args.student_epochs}"] if args.student_epochs else []
            folder = out / split / f"seed{seed}"
            students[seed] = run(folder, "lm_distill.yaml", [*student_args, *args.student_args], after=teacher_args)
            print(f"{split} seed {seed}: {students[seed]}", flush=True)
        results[split] = {"teacher": teacher, "students": students}
    settings = {"teacher_epochs": args.teacher_epochs, "student_epochs": args.student_epochs}
    settings["student_args"] = args.student_args
    (out / "results.json").write_text(json.dumps({**settings, **results}, indent=1))
    print(f"\nsettings (None: the config's): {settings}")
    print("| split | teacher | distilled student, mean (range) | control, mean (range) | control - student, per seed |")
    print("|---|---|---|---|---|")
    for split, result in results.items():
        runs = list(result["students"].values())
        gaps = ", ".join(f"{r['alone'] - r['student']:+.3f}" for r in runs)
        student, alone = spread([r["student"] for r in runs]), spread([r["alone"] for r in runs])
        print(f"| {split} | {result['teacher']['perplexity']:.3f} | {student} | {alone} | {gaps} |")


if __name__ == "__main__":
    main()
