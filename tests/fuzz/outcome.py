"""Classify what a case's run gave against the reference: match, mismatch, documented or undocumented error, hang.

* **match**: every rank's final weights, and every gradient its hooks read, within the tolerance of the case's
  precision (:data:`TOLERANCES`) of plain PyTorch.
* **mismatch**: the run finished, and something is outside it: a silent wrong result.
* **documented**: an error the strategy raises itself, with a message that says what to do: raised in
  ``lightning_multids`` and containing one of the messages of its ``raise`` statements (:func:`signatures`).
* **undocumented**: any other error (DeepSpeed's internals, torch's, an assertion).
* **hang**: a rank did not finish in time.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import lightning_multids
from tests.fuzz.grammar import Case
from tests.fuzz.reference import Result

KINDS = ("match", "mismatch", "documented", "undocumented", "hang")
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Tolerance:
    """``|got - expected| <= atol + rtol * |expected|`` elementwise, or ``rtol * max|expected|`` with ``of_tensor``."""

    atol: float
    rtol: float
    of_tensor: bool = False

    def excess(self, got: torch.Tensor, expected: torch.Tensor) -> float:
        """The largest ``|got - expected| / allowed``: above 1 is outside the tolerance."""
        if got.shape != expected.shape:
            return float("inf")
        if not got.numel():
            return 0.0
        scale = expected.abs().max() if self.of_tensor else expected.abs()
        return float(((got - expected).abs() / (self.atol + self.rtol * scale)).max())


TOLERANCES = {
    ("32-true", "weights"): Tolerance(1e-5, 1e-5),
    ("32-true", "grads"): Tolerance(1e-5, 1e-5),
    ("bf16-mixed", "weights"): Tolerance(3e-2, 3e-2),
    ("bf16-mixed", "grads"): Tolerance(1e-3, 3e-2, of_tensor=True),
}
"""Per precision, for the final weights and for the gradients hooks read; fixed, never widened to pass.

fp32: the ranks sum and average in another order than one process, a few ulps (1e-7) per operation; 1e-5
leaves a hundredfold margin (the distributed suite's ``TOLERANCE``). bf16 keeps 8 significant bits and the
reference runs in fp32: weights within 3e-2, the suite's bf16 tolerance (``test_bf16_gan_trains_close_to_fp32``,
"bf16 resolution" in the README). A bf16 backward's error is relative to the size of the terms it sums, not of
their (possibly cancelling) sum, so a gradient is compared within 3% of its tensor's largest element (+1e-3):
plain PyTorch in bf16 (weights, forward and backward) stays within 0.5% of fp32 on most fuzz cases, and so the
strategy must too, with a sixfold margin. Not on all: a gradient penalty's second backward, or Adam's first
steps on a gradient near zero, can take plain bf16 itself past the tolerance; a mismatch says how far rounding alone
goes on its case (:func:`with_rounding_noise`). Weights under Adam hide a wrong gradient (Adam normalizes it); the
gradient reads do not.
"""

COLLECTIVE_FAILURE = re.compile(r"Connection (closed|reset)|Broken pipe|gloo", re.IGNORECASE)
"""A rank's error that only says another rank went away (the strategy's own ``on_exception`` test)."""


@dataclass
class Outcome:
    kind: str
    detail: str = ""
    error_type: str = ""
    where: str = ""
    """For an error: the innermost frame, ``file:function``."""
    worst: float = 0.0
    """For a finished run: the largest ``|got - expected| / tolerance`` (above 1 is a mismatch)."""
    seconds: float = 0.0
    errors: list[dict[str, Any]] = field(default_factory=list)

    def signature(self) -> tuple[str, ...]:
        """What the shrinker keeps: the class, and for an error its type and the innermost frame's file."""
        if self.kind in ("documented", "undocumented"):
            return (self.kind, self.error_type, self.where.split(":")[0])
        if self.kind == "mismatch":
            return (self.kind, self.detail.split(" ")[0])
        return (self.kind,)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- finished runs ---------------------------------------------------------------------------------------


def compare_tensors(got: Tensors, expected: Tensors, tolerance: Tolerance) -> tuple[float, str]:
    """The largest excess over ``tolerance`` among the tensors, and the key where it is."""
    if got.keys() != expected.keys():
        return float("inf"), f"keys differ: {sorted(got.keys() ^ expected.keys())}"
    return max(((tolerance.excess(got[k], expected[k]), k) for k in expected), default=(0.0, ""))


def compare_weights(got: Tensors, expected: Tensors, precision: str) -> tuple[float, str]:
    worst, where = compare_tensors(got, expected, TOLERANCES[precision, "weights"])
    return worst, f"weights: {where}"


def compare_reads(got: list[dict[str, Any]], expected: list[dict[str, Any]], precision: str) -> tuple[float, str]:
    if [(r["hook"], r["engine"]) for r in got] != [(r["hook"], r["engine"]) for r in expected]:
        return float("inf"), f"reads: {len(got)} hook reads, plain PyTorch {len(expected)}"
    worst, where = 0.0, ""
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        ratio, key = compare_tensors(mine["grads"], theirs["grads"], TOLERANCES[precision, "grads"])
        if ratio > worst:
            worst, where = ratio, f"reads: #{index} {mine['hook']} of {mine['engine']}: {key}"
    return worst, where


def compare(case: Case, expected: Result, ranks: list[dict[str, Any]]) -> Outcome:
    """Compare every rank's weights and hook reads with the reference's."""
    reads = [read.to_dict() for read in expected.reads]
    worst, detail = 0.0, ""
    for rank, result in enumerate(ranks):
        for ratio, where in (
            compare_weights(result["weights"], expected.weights, case.precision),
            compare_reads(result["reads"], reads, case.precision),
        ):
            if ratio > worst:
                worst, detail = ratio, f"{where} on rank {rank}"
    seconds = max(float(result["seconds"]) for result in ranks)
    kind = "mismatch" if worst > 1.0 else "match"
    return Outcome(kind, detail=detail if kind == "mismatch" else "", worst=worst, seconds=seconds)


def with_rounding_noise(found: Outcome, case: Case, expected: Result, noise: Result, how: str) -> Outcome:
    """A mismatch, its detail extended with how far ``noise`` (:func:`~tests.fuzz.reference.rounding_noise`, found
    ``how``) lands from the reference: the case's own noise floor.

    The verdict stays. The note shows whether rounding alone comes near the tolerance on this case (a gradient
    penalty that makes the weights grow, Adam's first steps on a gradient near zero, bf16), for the reader to judge.
    """
    if found.kind != "mismatch":
        return found
    weights = {key: value.float() for key, value in noise.weights.items()}
    reads = [read.to_dict() for read in expected.reads]
    worst, where = max(
        compare_weights(weights, expected.weights, case.precision),
        compare_reads([read.to_dict() for read in noise.reads], reads, case.precision),
    )
    found.detail += f" ({how}: {worst:.2f} of the tolerance, at {where})"
    return found


# ---- errors ----------------------------------------------------------------------------------------------


@functools.cache
def signatures() -> tuple[str, ...]:
    """The literal parts (20 characters or more) of every message ``lightning_multids`` raises.

    A message is the argument of a ``raise``: a string, or a call of a function of the package that builds it
    (``raise RuntimeError(self._no_torch_state(...))``), whose ``return`` statements' literal parts count.
    """
    trees = [ast.parse(path.read_text()) for path in Path(lightning_multids.__file__).parent.rglob("*.py")]
    builders: dict[str, list[ast.FunctionDef]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                builders.setdefault(node.name, []).append(node)
    found: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                message = node.exc.args[0]
                found.update(_literal_parts(message))
                if isinstance(message, ast.Call):
                    name = message.func.attr if isinstance(message.func, ast.Attribute) else ast.unparse(message.func)
                    for builder in builders.get(name, []):
                        for returned in ast.walk(builder):
                            if isinstance(returned, ast.Return) and returned.value is not None:
                                found.update(_literal_parts(returned.value))
    return tuple(sorted(found))


def _literal_parts(node: ast.expr) -> list[str]:
    """The string constants in ``node`` (an f-string's literal pieces, the parts of a concatenation)."""
    if isinstance(node, ast.Call):  # a message built by a call: see `signatures`
        return []
    pieces = [v.value for v in ast.walk(node) if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return [piece.strip() for piece in pieces if len(piece.strip()) >= 20]


def is_documented(error: dict[str, Any]) -> bool:
    """Raised by ``lightning_multids`` itself, with one of its messages."""
    innermost = error["frames"][-1] if error["frames"] else ""
    ours = "lightning_multids/" in innermost
    return ours and any(signature in error["message"] for signature in signatures())


def primary(errors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The error that started it: the first rank's that is not just another rank going away."""
    for error in errors:
        if not COLLECTIVE_FAILURE.search(error["message"]):
            return error
    return errors[0] if errors else None


def from_errors(errors: list[dict[str, Any]], timed_out: bool) -> Outcome:
    """The outcome of a run that did not finish: ``errors`` are the ranks' error records (possibly none)."""
    error = primary(errors)
    if timed_out:
        said = f" (a rank raised {error['type']}: {error['message'][:200]})" if error else ""
        return Outcome("hang", detail=f"a rank did not finish in time{said}", errors=errors)
    if error is None:
        return Outcome("undocumented", detail="a rank exited with no error recorded", errors=errors)
    frame = error["frames"][-1] if error["frames"] else ""
    where = f"{Path(frame.split(':')[0]).name}:{frame.rsplit(':', 1)[-1]}" if frame else ""
    kind = "documented" if is_documented(error) else "undocumented"
    first_line = error["message"].strip().splitlines()[0] if error["message"].strip() else ""
    return Outcome(kind, detail=first_line[:300], error_type=error["type"], where=where, errors=errors)
