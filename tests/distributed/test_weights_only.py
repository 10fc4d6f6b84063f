"""A checkpoint loads as ``weights_only`` says, every part of it: a poisoned part runs nothing unless trusted.

As ``torch.load`` and Lightning's own strategies: with ``weights_only=True`` or the default, a file holding anything
but tensors and plain types is refused and the error names it; with ``weights_only=False`` it loads.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import REPO, run_ranks
from tests.poison import poison

SCRIPT = Path(__file__).with_name("run_weights_only.py")

PARTS = {
    "lightning": "lightning.pt",
    "model_states": "engines/student/state/mp_rank_00_model_states.pt",
    "optimizer_states": "engines/student/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "frozen_weights": "engines/teacher/weights.pt",
    "ema_weights": "engines/student_ema/weights.pt",
}
"""Each kind of file in a checkpoint of run_weights_only.py's module, by the name of its case."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights_only")
    run_ranks(SCRIPT, "train", str(root))
    assert sorted(str(p.relative_to(root / "ckpts" / "last.ckpt")) for p in (root / "ckpts").rglob("*.pt")) == sorted(
        [*PARTS.values(), "engines/student/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    )
    return root


def poisoned_copy(root: Path, name: str, part: str) -> tuple[Path, Path]:
    """ROOT/cases/NAME/last.ckpt, a copy of the trained checkpoint with ``part`` poisoned; and its marker."""
    copy = root / "cases" / name / "last.ckpt"
    shutil.copytree(root / "ckpts" / "last.ckpt", copy)
    marker = root / "cases" / f"{name}.ran"
    poison(copy / part, marker)
    return copy / part, marker


def test_every_poisoned_part_is_refused_unless_weights_only_is_false(trained: Path) -> None:
    cases, expected = [], {}
    for part, file in PARTS.items():
        for weights_only in ("none", "true", "false"):
            name = f"{part}-{weights_only}"
            expected[name] = poisoned_copy(trained, name, file)
            cases.append(f"{name}:{weights_only}:fit")
    for name, call in (("validate-none", "validate:none"), ("validate-false", "validate:false")):
        expected[name] = poisoned_copy(trained, name, PARTS["ema_weights"])
        cases.append(f"{name}:{call.split(':')[1]}:validate")
    outputs = run_ranks(SCRIPT, "load", str(trained), *cases, timeout=600)
    for rank, output in enumerate(outputs):
        results = dict(re.findall(r"^RESULT ([\w-]+): (.*)$", output, flags=re.M))
        assert sorted(results) == sorted(expected), output[-3000:]
        for name, (file, marker) in expected.items():
            if name.endswith("-false"):
                assert results[name] == "ok", f"rank {rank}, {name}: {results[name]}"
                assert marker.exists(), f"{name}: weights_only=False loads every object, as torch.load does"
                continue
            assert not marker.exists(), f"{name}: the poisoned file ran code"
            message = results[name]
            assert message.startswith("UnpicklingError: Refusing to load"), f"rank {rank}, {name}: {message}"
            assert repr(str(file)) in message and "tests.poison.touched" in message, message
            assert "pass `weights_only=False` to `trainer.fit`" in message, message


def test_restricted_loading_does_not_depend_on_the_look_before_loading(trained: Path) -> None:
    """With the look at the pickles blinded, torch's restricted unpickler refuses the file DeepSpeed reads itself.

    DeepSpeed reads the model states on every rank (``torch.load(..., weights_only=False)`` in its code).
    """
    file, marker = poisoned_copy(trained, "bypassed", PARTS["model_states"])
    outputs = run_ranks(SCRIPT, "load", str(trained), "bypassed:none:fit:bypass")
    for output in outputs:
        message = re.search(r"^RESULT bypassed: (.*)$", output, flags=re.M)
        assert message is not None, output[-3000:]
        assert message.group(1).startswith("UnpicklingError: Refusing to load"), message.group(1)
        assert str(file.parents[3]) in message.group(1) and "tests.poison.touched" in message.group(1)
    assert not marker.exists()


def test_a_saved_average_whose_submodule_is_gone_is_refused_with_strict_loading(trained: Path) -> None:
    shutil.copytree(trained / "ckpts" / "last.ckpt", trained / "cases" / "no-ema" / "last.ckpt")
    outputs = run_ranks(SCRIPT, "load", str(trained), "no-ema:none:fit:no-ema")
    for output in outputs:
        message = re.search(r"^RESULT no-ema: (.*)$", output, flags=re.M)
        assert message is not None, output[-3000:]
        expected = r"ValueError: The checkpoint .* holds the weights of the submodule 'student_ema', which this"
        assert re.match(expected, message.group(1)), message.group(1)


@pytest.mark.parametrize("part", sorted(PARTS))
def test_export_refuses_a_poisoned_part_unless_unsafe_load(trained: Path, part: str) -> None:
    file, marker = poisoned_copy(trained, f"export-{part}", PARTS[part])
    out = trained / "exported" / part
    command = [
        sys.executable,
        "-m",
        "lightning_multids.cli",
        "export",
        str(trained / "cases" / f"export-{part}" / "last.ckpt"),
        str(out),
    ]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Refusing to load" in refused.stderr and repr(str(file)) in refused.stderr, refused.stderr[-3000:]
    assert "--unsafe-load" in refused.stderr and "Traceback" not in refused.stderr
    assert not marker.exists() and not out.exists()
    loaded = subprocess.run([*command, "--unsafe-load"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert marker.exists()
    assert sorted(p.name for p in out.iterdir()) == ["plain.pt", "student.pt", "student_ema.pt", "teacher.pt"]
