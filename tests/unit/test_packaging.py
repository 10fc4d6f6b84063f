"""What ``pyproject.toml`` admits is what CI runs, and installing the project keeps the torch already there.

The lanes are read from the Makefile (``make print-lanes``). A dry run of ``make test-all`` shows that each is
run: a venv made with the lane's Python, the lane's torch installed into it, and the whole suite run in it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
MAKE_VARIABLES = ("VENV", "TORCH_SPEC", "TORCH_INDEX", "PYTHON", "PYTEST_ARGS", "WHEELHOUSE", "CPYTHON", "LANE")
"""Variables the Makefile reads that a lane (or the user) may have in the environment, with make's own."""


def make(*args: str) -> str:
    inherited = (*MAKE_VARIABLES, "EXPECTED_", "MAKE", "MFLAGS")
    environment = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    proc = subprocess.run(
        ["make", "--no-print-directory", *args], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def lanes() -> set[tuple[str, str]]:
    """The Makefile's lanes as (Python minor, torch version)."""
    return {(python, torch) for python, torch in (line.split() for line in make("-s", "print-lanes").splitlines())}


def dry_run_of_test_all() -> list[str]:
    """The commands ``make test-all`` runs, each lane's Python shown as ``python MINOR``."""
    return make("-n", "-B", "test-all", "CPYTHON=echo python").splitlines()


def whole_suite_runs(commands: list[str], examples: bool = False) -> set[tuple[str, str]]:
    """(Python minor, torch version) of every venv that the commands make and run the whole suite in.

    The whole suite but the examples' command-line runs (``-m 'not examples'``) counts too, unless ``examples``.
    """
    pythons, torches, suites = {}, {}, set()
    deselect = "" if examples else r"(?: -m 'not examples')?"
    for command in commands:
        if made := re.fullmatch(r"python (\d+\.\d+) -m venv (\S+)", command):
            pythons[made[2]] = made[1]
        elif installed := re.match(r"(\S+)/bin/python -m pip install .*\"torch==([\d.]+)\"", command):
            torches[installed[1]] = installed[2]
        elif suite := re.fullmatch(rf"(?:EXPECTED_[A-Z]+=\S+ )*(\S+)/bin/python -m pytest tests{deselect}", command):
            suites.add(suite[1])
    return {(pythons[venv], torches[venv]) for venv in suites if venv in pythons and venv in torches}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def torch_specifier() -> SpecifierSet:
    requirements = [Requirement(dependency) for dependency in pyproject()["project"]["dependencies"]]
    pins = [requirement for requirement in requirements if requirement.name == "torch"]
    assert len(pins) == 1 and pins[0].marker is None, f"one torch pin for every environment, not {pins}"
    return pins[0].specifier


def assert_admits_only(what: str, specifier: SpecifierSet, tested: list[Version]) -> None:
    """``specifier`` admits every minor release from the oldest tested one to the newest, and no other."""
    major = tested[0].major
    admitted = [minor for minor in range(50) if specifier.contains(Version(f"{major}.{minor}.0"))]
    minors = sorted(version.minor for version in tested)
    assert admitted == list(range(minors[0], minors[-1] + 1)), (
        f"pyproject.toml admits {what} {specifier} ({major}.x minors {admitted}); CI's lanes (Makefile) run "
        f"{major}.{minors[0]} to {major}.{minors[-1]}: admit exactly that range, or add a lane"
    )


def test_make_test_all_runs_the_whole_suite_on_every_lane() -> None:
    commands = dry_run_of_test_all()
    assert lanes() == whole_suite_runs(commands, examples=True)
    assert not ignored_failures(commands, (REPO / "Makefile").read_text())


def ignored_failures(commands: list[str], makefile: str) -> list[str]:
    """What lets ``make test-all`` go on, or pass, after a command fails."""
    ignored = [command for command in commands if "||" in command]
    ignored += re.findall(r"^\t@?-.*", makefile, re.M)  # make -n drops the "-"
    ignored += re.findall(r"^\.IGNORE:.*|.*\$\(MAKE\).* (?:-[a-zA-Z]*i[a-zA-Z]*|--ignore-errors)\b.*", makefile, re.M)
    return ignored


def test_pyproject_admits_the_pythons_of_the_lanes_and_none_beyond() -> None:
    specifier = SpecifierSet(pyproject()["project"]["requires-python"])
    assert_admits_only("Python", specifier, [Version(python) for python, _ in lanes()])


def test_pyproject_admits_the_torches_of_the_lanes_and_none_beyond() -> None:
    assert_admits_only("torch", torch_specifier(), [Version(torch) for _, torch in lanes()])


def test_the_dry_run_parser_sees_a_lane_that_does_not_run() -> None:
    """The parser behind the lane test: a lane whose suite is a subset, or whose venv has no torch, is not run."""
    commands = ["python 3.13 -m venv .v", '.v/bin/python -m pip install --quiet "torch==2.15.0"']
    assert whole_suite_runs([*commands, "X=1 .v/bin/python -m pytest tests"]) == set()
    assert whole_suite_runs([*commands, "X=1 .v/bin/python -m pytest tests/unit"]) == set()
    assert whole_suite_runs([commands[0], "X=1 .v/bin/python -m pytest tests"]) == set()
    assert whole_suite_runs([*commands, "EXPECTED_TORCH=torch EXPECTED_PYTHON=3.13 .v/bin/python -m pytest tests"]) == {
        ("3.13", "2.15.0")
    }
    assert whole_suite_runs([*commands, "PYTEST_ADDOPTS=--lf .v/bin/python -m pytest tests"]) == set()
    left_out = "EXPECTED_PYTHON=3.13 .v/bin/python -m pytest tests -m 'not examples'"
    assert whole_suite_runs([*commands, left_out]) == {("3.13", "2.15.0")}
    assert whole_suite_runs([*commands, left_out], examples=True) == set()
    assert whole_suite_runs([*commands, "X=1 .v/bin/python -m pytest tests -m 'not slow'"]) == set()


@pytest.mark.parametrize(
    "makefile",
    [
        "\t-$(PY) -m pytest tests",
        ".IGNORE: lane",
        "\t$(MAKE) -i lane",
        "\t$(MAKE) -si lane",
        "\t$(MAKE) --ignore-errors x",
    ],
)
def test_the_failure_check_sees_what_ignores_a_failure(makefile: str) -> None:
    assert ignored_failures([], makefile)
    assert ignored_failures(["a || true"], "")
    assert not ignored_failures(["make -s lane"], "\t$(MAKE) -s lane LANE=x VENV=.venv-py3.11-torch2.13.0")


def test_installing_the_project_keeps_the_installed_torch(tmp_path: Path) -> None:
    """pip's own dry run of installing the project here, offline: it must not want another torch."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--no-index"]
    proc = subprocess.run([*command, "--report", str(report), str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, f"pip install . would not keep torch {torch.__version__}:\n{proc.stderr[-3000:]}"
    to_install = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert to_install == {"lightning-multids"}, f"pip install . would also install {to_install}"


@pytest.mark.skipif(not os.environ.get("EXPECTED_TORCH"), reason="set by the Makefile's pytest target")
def test_the_venv_runs_the_torch_it_installed_first() -> None:
    """torch, then DeepSpeed and the project were installed: the torch that runs is still the first one."""
    expected = Requirement(os.environ["EXPECTED_TORCH"])
    assert expected.specifier.contains(Version(torch.__version__)), f"torch {torch.__version__} is not {expected}"


@pytest.mark.skipif(not os.environ.get("EXPECTED_PYTHON"), reason="set by the Makefile's lanes")
def test_the_lane_runs_its_python() -> None:
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == os.environ["EXPECTED_PYTHON"]


def third_party_imports(folder: str) -> set[str]:
    """The top-level modules that the Python files under ``folder`` import, beside the standard library's and ours."""
    found = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"lightning_multids", "examples", "__future__"}


def distributions(requirements: list[str]) -> set[str]:
    """The distributions named by ``requirements`` and those they require (one level), by normalized name."""
    names = {canonicalize_name(Requirement(requirement).name) for requirement in requirements}
    required = {
        canonicalize_name(Requirement(requirement).name)
        for name in names
        for requirement in importlib.metadata.requires(name) or []
        if "extra ==" not in requirement
    }
    return names | required


def providers(module: str) -> set[str]:
    """The distributions that install the top-level module ``module``."""
    return {canonicalize_name(name) for name in importlib.metadata.packages_distributions().get(module, [module])}


OPTIONAL_IMPORTS = {"transformers", "peft"}
"""Imported only by the Hugging Face export, which says to install them when missing."""


def test_runtime_dependencies_are_what_the_library_imports() -> None:
    """The library's own imports need nothing undeclared, and it declares nothing it does not use."""
    project = pyproject()["project"]
    declared = {canonicalize_name(Requirement(dependency).name) for dependency in project["dependencies"]}
    imported = third_party_imports("lightning_multids") - OPTIONAL_IMPORTS
    for module in imported:
        assert providers(module) & distributions(project["dependencies"]), f"{module} is imported but not declared"
    used = set().union(*(providers(module) for module in imported)) | {"jsonargparse"}  # LightningCLI's, for `fit`
    assert declared <= used, f"declared but not imported by the library: {declared - used}; move them to an extra"


def test_the_examples_extra_holds_what_the_examples_import() -> None:
    """Declared directly: what another package happens to require in one release is no promise (tensorboard 2.15
    does not require pillow; later releases do)."""
    project = pyproject()["project"]
    declared = {
        canonicalize_name(Requirement(requirement).name)
        for requirement in project["dependencies"] + project["optional-dependencies"]["examples"]
    }
    for module in third_party_imports("examples"):
        assert providers(module) & declared, f"examples/ imports {module}: add it to the `examples` extra"


def test_the_realcode_extra_holds_what_the_real_code_suite_imports() -> None:
    """tests/realcode fits public packages' code: each one it imports is declared, where `make install` installs it."""
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    declared = {
        canonicalize_name(Requirement(requirement).name)
        for requirement in project["dependencies"] + extras["examples"] + extras["dev"] + extras["realcode"]
    }
    for module in third_party_imports("tests/realcode") - {"tests"}:
        assert providers(module) & declared, f"tests/realcode imports {module}: add it to the `realcode` extra"
    assert ".[dev,examples,realcode]" in (REPO / "Makefile").read_text(), "the Makefile's install leaves it out"
