"""The package graph has no cycles: `autotune` (the library and the client) knows neither the
server nor the worker, the server never loads torch, and server and worker know only autotune.

Every module's imports are read from its source (ast), wherever they are: at the top, inside
functions, under `if TYPE_CHECKING:`, as string literals given to `importlib.import_module` or
`__import__`, and as any string that names one of our modules (`"probes.cli:register"`, kept in
a table and imported later). The deployables plug into autotune through entry points
(pyproject.toml), which is why none of these edges is needed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("autotune", "api", "probes")

# (importing package, imported top-level package): edges that must not exist.
FORBIDDEN = {
    ("autotune", "api"),
    ("autotune", "probes"),
    ("api", "probes"),
    ("api", "torch"),
    ("probes", "api"),
}
# Loading these makes a process heavy; the server image does not have them.
TORCH_SIDE = ("torch",)
# A whole string that names a module of ours, optionally with an attribute: "probes.cli:register".
_MODULE_STRING = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?::[\w.]+)?$")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name as written (resolved if relative)
    line: int
    at_import_time: bool  # runs when the importer is imported (top level, not TYPE_CHECKING)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _string_import(call: ast.Call) -> str | None:
    """The module of `importlib.import_module("x")`, `import_module("x")`, `__import__("x")`."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def imports_of(source: str, importer: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every import in `source`, with whether it runs when the module is imported."""

    def visit(node: ast.AST, at_import_time: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, node.lineno, at_import_time)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node.module, node.level)
            yield Import(importer, base, node.lineno, at_import_time)
            if node.module is None:  # `from . import x` imports the submodule x
                for alias in node.names:
                    yield Import(importer, f"{base}.{alias.name}", node.lineno, at_import_time)
        elif isinstance(node, ast.Call):
            target = _string_import(node)
            if target is not None:
                yield Import(importer, target, node.lineno, at_import_time)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _MODULE_STRING.match(node.value)
            if named:
                yield Import(importer, named.group(1), node.lineno, False)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import_time = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, False)
            for child in node.orelse:
                yield from visit(child, at_import_time)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, at_import_time)

    yield from visit(ast.parse(source), True)


def project_imports() -> list[Import]:
    found: list[Import] = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = module_name(path)
            found += imports_of(path.read_text(), name, is_package=path.name == "__init__.py")
    return found


def top(module: str) -> str:
    return module.partition(".")[0]


# ---------------------------------------------------------------------------------------------
# The reader finds every form of import (else the graph tests below would pass vacuously).


def test_the_reader_finds_imports_in_functions_strings_and_type_checking_blocks() -> None:
    source = (
        "from __future__ import annotations\n"
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from api.store.db import Database\n"
        "def serve():\n"
        "    import uvicorn\n"
        "    from api.main import create_app\n"
        "    importlib.import_module('probes.cli_worker')\n"
        "    __import__('torch')\n"
        "COMMANDS = [('api.cli', 'register'), ('autotune.cli.tune:register', None)]\n"
    )
    found = {(i.imported, i.at_import_time) for i in imports_of(source, "autotune.cli.main")}
    assert found == {
        ("__future__", True),
        ("importlib", True),
        ("typing", True),
        ("autotune.cli", True),
        ("autotune.cli.sibling", True),
        ("api.store.db", False),
        ("uvicorn", False),
        ("api.main", False),
        ("probes.cli_worker", False),
        ("torch", False),
        ("api.cli", False),
        ("autotune.cli.tune", False),
    }


# ---------------------------------------------------------------------------------------------
# The graph


@pytest.mark.parametrize(("importer", "imported"), sorted(FORBIDDEN))
def test_forbidden_edge_is_absent(importer: str, imported: str) -> None:
    offending = [
        f"{i.importer}:{i.line} imports {i.imported}"
        for i in project_imports()
        if top(i.importer) == importer and top(i.imported) == imported
    ]
    assert not offending, "\n".join(offending)


def test_the_server_loads_no_torch_through_the_library() -> None:
    """What `api` imports at import time, followed through our own modules, never reaches torch
    (test_no_torch checks the same at run time for the modules a server loads)."""
    edges: dict[str, set[str]] = {}
    for found in project_imports():
        if found.at_import_time:
            edges.setdefault(found.importer, set()).add(found.imported)
    modules = set(edges)

    def ours(name: str) -> list[str]:
        # `from autotune import schemas` names autotune; a dotted name also loads its parents.
        parts = name.split(".")
        return [m for m in (".".join(parts[:n]) for n in range(1, len(parts) + 1)) if m in modules]

    seen: dict[str, str] = {}  # module -> the module that first imported it
    stack = [m for m in modules if top(m) == "api"]
    for start in stack:
        seen[start] = start
    while stack:
        current = stack.pop()
        for imported in edges.get(current, ()):
            assert top(imported) not in TORCH_SIDE, _path(seen, current) + f" -> {imported}"
            for module in ours(imported):
                if module not in seen:
                    seen[module] = current
                    stack.append(module)


def _path(seen: dict[str, str], module: str) -> str:
    chain = [module]
    while seen[chain[-1]] != chain[-1]:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))
