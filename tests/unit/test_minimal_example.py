"""``examples/minimal.py`` holds the README's snippet as printed: code that runs (the doc test runs it)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_snippet() -> str:
    """The README's first Python block from ``class GAN`` to the line that builds the Trainer."""
    block = (REPO / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("class GAN("))
    end = next(i for i, line in enumerate(lines) if line.startswith("trainer = pl.Trainer("))
    return "\n".join(lines[start : end + 1])


def test_the_minimal_example_holds_the_readmes_snippet_as_printed() -> None:
    snippet = readme_snippet()
    assert snippet.count("\n") > 30, snippet
    assert snippet in (REPO / "examples" / "minimal.py").read_text(), "README.md and examples/minimal.py differ"


def test_the_readme_runs_the_minimal_example() -> None:
    assert "python -m examples.minimal" in (REPO / "README.md").read_text()
