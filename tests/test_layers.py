"""The import graph of the installed package: no circle, and imports only going down the harness's layers.

Read from the code of the installed `kvspec` (every import statement, at
module level or inside a function), not from a list kept by hand:

- no import circle among kvspec's modules;
- `kvspec.conformance` in layers, each importing only from the layers before it:
  core, runner, targets, tools; the first two know nothing of the project
  but the spec (no implementation, mutant or benchmark);
- the spec imports nothing else of the project; the reference only the spec;
  gpu_impl only the spec, and its adapter the harness's core protocols;
- an import inside a function only for an optional dependency, with a comment saying so.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ("spec", "reference", "conformance", "gpu_impl", "mutants", "benchmarks")
LAYERS = ("core", "runner", "targets", "tools")  # kvspec.conformance's, lowest first
# What may be imported inside a function: optional dependencies (extras), and Hypothesis's internals,
# which move between releases (their absence is handled where they are used).
OPTIONAL = ("crosshair", "z3", "matplotlib", "torch", "packaging", "hypothesis.internal",
            "kvspec.spec.lemmas", "kvspec.gpu_impl", "kvspec.benchmarks")  # fmt: skip


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (a package's submodule where `from package import submodule`)
    in_function: bool
    commented: bool  # a comment on the line, or just above the block of imports it belongs to


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(f"kvspec.{package}")
        assert spec is not None and spec.submodule_search_locations, package
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(("kvspec", package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = _modules()


def _commented(lines: list[str], line_no: int) -> bool:
    """A comment on the import's line, or on the line above the block of imports it stands in."""
    k = line_no - 2
    while k >= 0 and lines[k].strip().startswith(("from ", "import ")):
        k -= 1
    return "#" in lines[line_no - 1] or (k >= 0 and lines[k].strip().startswith("#"))


def _imports_of(module: str, path: Path) -> Iterator[Import]:
    lines = path.read_text().splitlines()
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, in_function, _commented(lines, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".")[: len(module.split(".")) - child.level + is_package]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    yield Import(module, sub if sub in MODULES else base, in_function, _commented(lines, child.lineno))
            else:
                yield from visit(child, inside)

    yield from visit(ast.parse("\n".join(lines)), False)


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports_of(module, path)]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["kvspec", "conformance"] or len(parts) < 3 or parts[2] not in LAYERS:
        return None
    return LAYERS.index(parts[2])


def test_the_package_was_found() -> None:
    assert "kvspec.conformance.core.lockstep" in MODULES and "kvspec.spec.ops" in MODULES
    assert len(IMPORTS) > 500


def test_no_import_circle() -> None:
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if imp.target in MODULES and imp.target != imp.module:
            edges.setdefault(imp.module, set()).add(imp.target)
    # Tarjan's strongly connected components, iteratively: any with two modules or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in MODULES:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    assert circles == []


def test_the_harness_imports_only_down_its_layers() -> None:
    upward = [
        f"{imp.module} -> {imp.target}"
        for imp in IMPORTS
        if (low := _layer(imp.module)) is not None and (high := _layer(imp.target)) is not None and high > low
    ]
    assert upward == []


def test_the_core_and_the_runner_know_no_implementation() -> None:
    known = [
        f"{imp.module} -> {imp.target}"
        for imp in IMPORTS
        if (_layer(imp.module) or 0) <= LAYERS.index("runner")
        and imp.module.startswith("kvspec.conformance.")
        and imp.target.startswith(("kvspec.reference", "kvspec.gpu_impl", "kvspec.mutants", "kvspec.benchmarks"))
    ]
    assert known == []


@pytest.mark.parametrize(
    ("package", "may_import"),
    [
        ("kvspec.spec", ("kvspec.spec",)),
        ("kvspec.reference", ("kvspec.spec", "kvspec.reference")),
        ("kvspec.gpu_impl", ("kvspec.spec", "kvspec.gpu_impl")),
    ],
)
def test_the_spec_and_the_implementations_stand_alone(package: str, may_import: tuple[str, ...]) -> None:
    # gpu_impl's adapter speaks the harness's protocols (it is the one module that knows the harness).
    allowed = {"kvspec.gpu_impl.adapter": ("kvspec.conformance.core",)}
    outside = [
        f"{imp.module} -> {imp.target}"
        for imp in IMPORTS
        if imp.module.startswith(package) and imp.target.startswith("kvspec.")
        and not imp.target.startswith(may_import + allowed.get(imp.module, ()))
    ]  # fmt: skip
    assert outside == []


def test_no_command_imports_the_command_line_that_discovers_it() -> None:
    # cli imports every module of tools.commands by name at run time, which the graph above cannot see.
    assert [i.module for i in IMPORTS if i.target == "kvspec.conformance.tools.cli" and ".commands." in i.module] == []


def test_an_import_inside_a_function_is_an_optional_dependency_and_says_so() -> None:
    hidden = [
        f"{imp.module}: {imp.target}"
        for imp in IMPORTS
        if imp.in_function
        and (not imp.commented or not any(imp.target == o or imp.target.startswith(o + ".") for o in OPTIONAL))
    ]
    assert hidden == []


def test_no_function_of_the_product_is_60_lines_or_more() -> None:
    # Counted from its def to its last line, docstring included: a reader holds the whole of it in their head.
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length >= 60:
                    long.append(f"{module}.{node.name}: {length} lines")
    assert long == []
