"""The wheels carried to the GPU machine: what to download, and whether the folder is complete for its Python.

``pins NAME...`` prints each name as ``NAME==VERSION`` where this environment has it installed (the versions the
suites ran with), else the bare name. ``check DIR --python-version 3.12`` checks, without that Python, that every
wheel in DIR installs on CPython of that version on x86-64 Linux (its tags) and that everything each one requires
there (its ``Requires-Dist`` under that Python's markers, with the extras the package asks for) is either carried in
DIR, at a version the requirement admits, or installed in the running environment, which stands for what the GPU
machine has (``make gpu-wheels-proof`` runs it in a venv holding only that). Exits non-zero naming what is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
EXTRAS = {"jsonargparse": {"signatures"}}
"""The extras of carried packages that the project asks for (pyproject.toml: ``jsonargparse[signatures]``)."""


def pins(names: list[str]) -> list[str]:
    result = []
    for name in names:
        try:
            result.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            result.append(name)
    return result


def supported_tags(python: tuple[int, int]) -> set[Tag]:
    return {*cpython_tags(python, platforms=PLATFORMS), *compatible_tags(python, platforms=PLATFORMS)}


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(archive.read(metadata).decode())
    return [Requirement(line) for line in headers.get_all("Requires-Dist") or []]


def problems(folder: Path, python: tuple[int, int]) -> list[str]:
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return [f"no wheel in {folder}"]
    tags, found = supported_tags(python), []
    carried: dict[str, Version] = {}
    for wheel in wheels:
        name, version, _, wheel_tags = parse_wheel_filename(wheel.name)
        carried[name] = version
        if not wheel_tags & tags:
            found.append(f"{wheel.name} does not install on CPython {python[0]}.{python[1]} on x86-64 Linux")
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    environment = {"python_version": f"{python[0]}.{python[1]}", "python_full_version": f"{python[0]}.{python[1]}.0"}
    environment.update(sys_platform="linux", platform_system="Linux", platform_machine="x86_64", os_name="posix")
    for wheel in wheels:
        name = parse_wheel_filename(wheel.name)[0]
        for requirement in requirements(wheel):
            extras = EXTRAS.get(name, set()) | {""}
            marker = requirement.marker
            if marker is not None and not any(marker.evaluate({**environment, "extra": e}) for e in extras):
                continue
            needed = canonicalize_name(requirement.name)
            if needed in carried:
                if not requirement.specifier.contains(carried[needed], prereleases=True):
                    found.append(f"{wheel.name} needs {requirement}, and {needed} {carried[needed]} is carried")
            elif needed not in installed:
                found.append(f"{wheel.name} needs {requirement}: neither carried nor on the GPU machine")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pins").add_argument("names", nargs="+")
    check = commands.add_parser("check")
    check.add_argument("folder", type=Path)
    check.add_argument("--python-version", default="3.12")
    args = parser.parse_args()
    if args.command == "pins":
        print(" ".join(pins(args.names)))
        return 0
    major, minor = map(int, args.python_version.split("."))
    found = problems(args.folder, (major, minor))
    for problem in found:
        print(problem, file=sys.stderr)
    print(f"{args.folder}: {len(list(args.folder.glob('*.whl')))} wheels, {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
