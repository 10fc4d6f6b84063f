"""Upstream private names live in ``lightning_multids/_compat/``, one module per upstream, and nowhere else.

A private name is an underscore name of torch, Lightning or DeepSpeed:

* imported: ``from lightning.x import _name``, or a module path with an underscore part (``torch._C``, also as
  ``importlib.import_module("torch._C")``);
* read or set as an attribute where the package itself defines no such name: ``module._trainer``, and the same
  by its name as a string (``getattr(node, "_forward_cls")``, ``vars(x)["_name"]``, ``x.__dict__["_name"]``);
* an attribute of ``self`` in a class of the package whose torch, Lightning or DeepSpeed base class uses that
  name (``self._precision_plugin`` in a ``Strategy``), even where the package assigns it.

DeepSpeed's undocumented parameter attributes (``ds_numel``, ``partition_numel()``...) count too.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_multids"
COMPAT = PACKAGE / "_compat"
UPSTREAMS = ("torch", "lightning", "lightning_fabric", "lightning_utilities", "deepspeed")
DEEPSPEED_PARAMETER_ATTRIBUTES = ("ds_", "partition_numel")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Names the package defines: functions, classes, arguments, variables, attributes set on ``self``/``cls``."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


_BY_NAME = ("getattr", "hasattr", "setattr", "delattr")


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _named_by_string(node: ast.AST, own: set[str]) -> str | None:
    """A private name given as a string: ``getattr(x, "_n")``, ``vars(x)["_n"]``, ``x.__dict__["_n"]``, or a module
    path with a private part given to ``import_module``."""
    if isinstance(node, ast.Call) and len(node.args) >= 2 and ast.unparse(node.func) in _BY_NAME:
        name = _string(node.args[1])
        return name if name and _upstream_attribute(name, own) else None
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
        path = _string(node.args[0]) or ""
        parts = path.split(".")
        return path if parts[0] in UPSTREAMS and any(_private(part) for part in parts) else None
    if isinstance(node, ast.Subscript):
        holder = ast.unparse(node.value)
        name = _string(node.slice)
        if name and (holder.endswith(".__dict__") or holder.startswith("vars(")) and _upstream_attribute(name, own):
            return name
    return None


def upstream_private_uses(tree: ast.Module, own: set[str]) -> Iterator[tuple[int, str]]:
    """Each use of an upstream private name in ``tree``: its line and the name."""
    for node in ast.walk(tree):
        by_string = _named_by_string(node, own)
        if by_string is not None:
            yield node.lineno, by_string
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] in UPSTREAMS:
                if any(_private(part) for part in parts):
                    yield node.lineno, node.module
                yield from ((node.lineno, alias.name) for alias in node.names if _private(alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in UPSTREAMS and any(_private(part) for part in parts):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.Attribute) and _upstream_attribute(node.attr, own):
            yield node.lineno, ast.unparse(node)


def _upstream_attribute(name: str, own: set[str]) -> bool:
    return (_private(name) and name not in own) or name.startswith(DEEPSPEED_PARAMETER_ATTRIBUTES)


def _upstream_sources(cls: type) -> str:
    """The source of every torch, Lightning or DeepSpeed class ``cls`` derives from."""
    sources = []
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] in UPSTREAMS:
            with contextlib.suppress(OSError, TypeError):  # a class without Python source (C++)
                sources.append(inspect.getsource(base))
    return "\n".join(sources)


def inherited_private_uses(path: Path, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``self._name`` in a class of the package where an upstream base class of it uses ``_name`` too."""
    module = importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    for node in ast.walk(tree):
        cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not isinstance(cls, type):
            continue
        upstream = _upstream_sources(cls)
        if not upstream:
            continue
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "self"
                and _private(inner.attr)
                and f".{inner.attr}" in upstream
            ):
                yield inner.lineno, f"self.{inner.attr} (of an upstream base class)"


def test_no_upstream_private_name_outside_compat() -> None:
    trees = _trees()
    own = _own_names(trees)
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {name}"
        for path, tree in trees.items()
        if COMPAT not in path.parents
        for line, name in [*upstream_private_uses(tree, own), *inherited_private_uses(path, tree)]
    ]
    assert not found, "upstream private names outside lightning_multids/_compat/ (move each there):\n" + "\n".join(
        found
    )


def test_the_scan_sees_each_kind_of_private_use() -> None:
    code = (
        "from torch._C import _current_graph_task_id\n"
        "from lightning.pytorch.core.optimizer import _configure_optimizers\n"
        "import torch._dynamo\n"
        "trainer = module._trainer\n"
        "size = param.ds_numel\n"
        "self._mine = 1\n"
        "value = self._mine\n"
        "forward = getattr(node, '_forward_cls', None)\n"
        "hooks = vars(strategy)['_layer_sync']\n"
        "norm = engine.__dict__['_global_grad_norm']\n"
        "c = importlib.import_module('torch._C')\n"
        "mine = getattr(self, '_mine')\n"
    )
    names = [name for _, name in upstream_private_uses(ast.parse(code), _own_names({Path("x.py"): ast.parse(code)}))]
    assert names == [
        "torch._C",
        "_current_graph_task_id",
        "_configure_optimizers",
        "torch._dynamo",
        "module._trainer",
        "param.ds_numel",
        "_forward_cls",
        "_layer_sync",
        "_global_grad_norm",
        "torch._C",
    ]


def test_each_compat_module_says_the_versions_it_was_read_from() -> None:
    for path in sorted(COMPAT.glob("*.py")):
        if path.name == "__init__.py":
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "read from" in docstring.splitlines()[0], f"{path.name}: say which upstream versions it was read from"


PUBLIC_MODULES = [
    "lightning_multids",
    "lightning_multids.strategy",
    "lightning_multids.checkpoint",
    "lightning_multids.cli",
    "lightning_multids.utilities",
    "lightning_multids.utilities.gradcache",
    "lightning_multids.utilities.reductions",
    "lightning_multids.utilities.summary",
    "lightning_multids.utilities.progress",
]
"""The modules a user imports; every other module is marked as the package's own by a leading underscore."""


def test_every_module_is_public_with_all_or_marked_private() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        marked = any(part.startswith("_") and part != "__init__" for part in parts[1:])
        assert marked != (name in PUBLIC_MODULES), f"{name}: list it in PUBLIC_MODULES or give it a leading underscore"


def test_the_public_names_are_in_all_and_documented() -> None:
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        assert module.__doc__, f"{name} has no docstring"
        exported = getattr(module, "__all__", None)
        assert exported, f"{name} lists no public names in __all__"
        for public in exported:
            assert getattr(getattr(module, public), "__doc__", None), f"{name}.{public} has no docstring"


def _package_imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports, wherever the import stands (in a function, under TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE.name):
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            named = {name for name in submodules if _source(name).exists() or _source(name).with_suffix("").is_dir()}
            found |= named or {node.module}  # `from package import _module`: the module, not the package
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith(PACKAGE.name)}
    return found


def _source(module: str) -> Path:
    return (PACKAGE.parent / module.replace(".", "/")).with_suffix(".py")


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    """Each module's state has one owner: no two modules import each other, directly or through a circle."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        graph[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = _package_imports(path)

    def circle(start: str, module: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for imported in sorted(graph.get(module, ())):
            if imported == start:
                return (*seen, imported)
            if imported not in seen and imported != PACKAGE.name:
                found = circle(start, imported, (*seen, imported))
                if found:
                    return found
        return None

    circles = [found for start in graph if (found := circle(start, start, (start,)))]
    assert not circles, f"modules that import each other: {circles[0]}"
