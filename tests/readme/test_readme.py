"""The shell commands of README.md and of the guides in docs/, run as printed, in order, in one shell, on a fresh clone.

A new user follows README.md top to bottom (``make demo``, activating ``.venv``, TensorBoard), then the guides:
export, the CLI, the other examples. This test does the same: it clones the repository (``HEAD``, so what is
committed), takes every ```` ```bash ```` block of the clone's README in order, then those of each guide in
:data:`DOCS`, in that order, and runs them all as one bash script (``set -e``) in the clone. Two things differ
from typing them: ``tensorboard``, a server that runs until stopped, passes once it says where it serves;
and the output is checked for what a run must not print (:data:`tests.distributed.test_examples.AVOIDABLE`), for
the demo's digits (none below 5% of samples), and for the language models' results: the distilled student's
held-out perplexity below the control's, and DPO's held-out preference accuracy above 0.5.

It needs its own ``make demo`` install (a few minutes), so it runs only from ``make test-readme``
(``README_DOCTEST=1``), part of ``make test-all``. The unit tests of this file (how blocks are found, that every
guide with a bash block is in :data:`DOCS`) always run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.distributed.test_examples import AVOIDABLE, events

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 45 * 60
INSTALL_WARNINGS = ["`project.license` as a TOML table is deprecated"]
"""What installing the package must not print (setuptools, from ``pyproject.toml``)."""
PRELUDE = """set -eo pipefail
# TensorBoard serves until stopped: it passes once it says where it serves (within 60 s), and is stopped then.
tensorboard() {
  local log pid; log=$(mktemp)
  "$(type -P tensorboard)" "$@" > "$log" 2>&1 & pid=$!
  for _ in $(seq 120); do
    if grep -q "^TensorBoard .* at http" "$log"; then
      kill "$pid" 2> /dev/null || true; wait "$pid" || true; cat "$log"; rm -f "$log"; return 0
    fi
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.5
  done
  kill "$pid" 2> /dev/null || true; cat "$log"; rm -f "$log"; echo "tensorboard exited, or did not serve within 60 s"
  return 1
}
"""

DOCS = ["docs/checkpoints.md", "docs/command-line.md", "docs/examples.md", "docs/language-models.md"]
"""The guides whose bash blocks run after the README's, in this order. The README's blocks come first: they run
``make demo`` and activate ``.venv``. Each guide comes after those whose commands it needs: the checkpoint guide
exports the demo's checkpoint; the command-line guide validates and exports it too, and adds runs of its own
(``version_1``, ``version_2``); the examples' commands, the digits' and the language models', need only the
demo's install. A guide in ``docs/`` with a
bash block must be listed (:func:`test_every_guide_with_bash_blocks_is_run`)."""

doctest_only = pytest.mark.skipif(os.environ.get("README_DOCTEST") != "1", reason="run by `make test-readme`")


def bash_blocks(readme: str) -> list[str]:
    """The ```` ```bash ```` blocks of ``readme``, in order, each dedented by its fence's indentation."""
    blocks = re.findall(r"^( *)```bash\n(.*?)^\1```", readme, flags=re.M | re.S)
    return ["\n".join(line[len(indent) :] for line in body.splitlines()) for indent, body in blocks]


def test_bash_blocks_are_found_in_order() -> None:
    readme = "text\n```bash\nmake demo\n```\nmore\n  ```bash\n  lightning-multids export a b\n  ```\n"
    assert bash_blocks(readme) == ["make demo", "lightning-multids export a b"]


def script_blocks(root: Path) -> list[str]:
    """The bash blocks the test runs, in order: README.md's, then each of :data:`DOCS`'s."""
    return [block for path in ["README.md", *DOCS] for block in bash_blocks((root / path).read_text())]


def timed(number: int, block: str) -> str:
    """``block``, followed by a line of the log that says how long it took (bash's ``SECONDS``)."""
    return f'SECONDS=0\n{block}\necho "[bash block {number}: $SECONDS s]"\n'


def test_every_guide_with_bash_blocks_is_run() -> None:
    guides = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "docs").glob("*.md"))
    with_blocks = [guide for guide in guides if bash_blocks((REPO / guide).read_text())]
    missing = [guide for guide in with_blocks if guide not in DOCS]
    assert not missing, f"add these guides to DOCS in tests/readme/test_readme.py, after what they need: {missing}"
    assert len(set(DOCS)) == len(DOCS), f"a guide is listed twice in DOCS: {DOCS}"
    unknown = [guide for guide in DOCS if guide not in guides]
    assert not unknown, f"DOCS lists guides that do not exist: {unknown}"


def digit_shares(output: str) -> dict[int, float]:
    """The first ``Digits drawn:`` line of the output (the demo's) as digit -> share in percent."""
    line = re.search(r"^Digits drawn: +(.*)$", output, flags=re.M)
    assert line is not None, "the demo printed no class histogram"
    return {int(digit): float(share) for digit, share in re.findall(r"(\d): (\d+\.\d)%", line.group(1))}


def perplexities(output: str) -> dict[str, float]:
    """The distillation run's ``Held-out perplexity:`` line (``examples/lm_distill.py``) as model -> perplexity."""
    line = re.search(r"^Held-out perplexity: +(teacher .*) \(per byte\)$", output, flags=re.M)
    assert line is not None, "the language-model distillation printed no perplexities"
    return {name: float(value) for name, value in re.findall(r"(\w+) (\d+\.\d+)", line.group(1))}


def preference_accuracy(output: str) -> float:
    """The held-out accuracy from the DPO run's ``Held-out preference:`` line (``examples/dpo.py``)."""
    line = re.search(r"^Held-out preference: +accuracy (\d\.\d+), reward margin -?\d+\.\d+$", output, flags=re.M)
    assert line is not None, "the DPO run printed no preference accuracy"
    return float(line.group(1))


def true_continuation_preferred(output: str) -> dict[str, float]:
    """The DPO run's ``True continuation preferred:`` line (``examples/dpo.py``) as model -> share of pairs."""
    line = re.search(r"^True continuation preferred: +policy (\d\.\d+), reference (\d\.\d+)$", output, flags=re.M)
    assert line is not None, "the DPO run printed no shares of the true continuation preferred"
    return {"policy": float(line.group(1)), "reference": float(line.group(2))}


def test_the_language_models_results_are_read() -> None:
    output = "x\nHeld-out perplexity:  teacher 6.875, student 9.497, alone 10.619 (per byte)\n"
    output += "Held-out preference:  accuracy 0.934, reward margin 0.517\n"
    output += "True continuation preferred: policy 0.840, reference 0.809\n"
    assert perplexities(output) == {"teacher": 6.875, "student": 9.497, "alone": 10.619}
    assert preference_accuracy(output) == 0.934
    assert true_continuation_preferred(output) == {"policy": 0.84, "reference": 0.809}


@doctest_only
@pytest.mark.timeout(TIMEOUT + 60)  # its own limit, which kills the script's processes, comes first
def test_readme_commands_run_as_printed(tmp_path: Path) -> None:
    clone = tmp_path / "lightning-multids"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    script = PRELUDE + "".join(timed(number, block) for number, block in enumerate(script_blocks(clone), 1))
    (tmp_path / "readme.sh").write_text(script)
    inherited = ("VIRTUAL_ENV", "TORCH_EXTENSIONS", "PYTHONPATH", "MAKE", "MFLAGS")  # a new user's shell has none
    environment = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "readme.sh")],
        cwd=clone,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(
            f"the README's and guides' commands did not finish in {TIMEOUT} s:\n{output[-6000:]}"
        ) from None
    except BaseException:  # interrupted (Ctrl-C, .ci/beside.sh passing one on): the script's session goes too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    (tmp_path / "readme.log").write_text(output)
    assert proc.returncode == 0, f"a README or guide command failed ({proc.returncode}):\n{output[-8000:]}"
    for avoidable in AVOIDABLE + INSTALL_WARNINGS:
        assert avoidable not in output, f"the README's and guides' commands printed {avoidable!r}"
    shares = digit_shares(output)
    assert sorted(shares) == list(range(10)), shares
    assert min(shares.values()) >= 5.0, f"the demo's GAN draws some digit in under 5% of samples: {shares}"
    models = perplexities(output)
    assert models["student"] < models["alone"], f"distilling did not help the student: {models}"
    assert preference_accuracy(output) > 0.5, "DPO's held-out preference accuracy ended at 0.5 or below"
    preferred = true_continuation_preferred(output)
    assert preferred["policy"] > preferred["reference"], f"DPO did not prefer the true continuation more: {preferred}"
    for folder in ("outputs/lm/exported/student", "outputs/lm/exported-dpo/policy"):  # loaded by from_pretrained
        assert f"{folder}: 'Return the " in output, f"examples/generate.py did not continue a prompt with {folder}"
    distilled = set(events(clone / "outputs/lm/distilled/version_0").Tags()["scalars"])
    assert {"train/distill", "val/student_perplexity", "val/alone_perplexity"} <= distilled, distilled
    dpo = set(events(clone / "outputs/lm/dpo/version_0").Tags()["scalars"])
    assert {"train/loss", "train/reward_margin", "val/accuracy"} <= dpo, dpo
