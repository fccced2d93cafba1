"""The import layering that docs/architecture.md states, checked against every module of src/asyncgrpo.

The doc's "Layers, top first:" paragraph is the one list of the order: its layers are separated by
`>`, and each names its units in backticks, a unit being a subpackage (`server/`) or a top-level
module (`cli`, `__init__` for the package face `asyncgrpo/__init__.py`). The tests read it, so the
doc and the code cannot drift apart:

- every unit under src/asyncgrpo is in exactly one layer, and the doc names nothing that is not there;
- an import that crosses units points to a strictly lower layer (two units of one layer never import
  each other), and no two units import each other whatever the doc says;
- no module is part of an import cycle (within a package too).

Imports are read with `ast` from every file: module-level and function-level ones, `from . import x`
relative forms, `from asyncgrpo import Name` (the package face) and `import asyncgrpo.x.y`. Imports
under `if TYPE_CHECKING:` are exempt: they never run, they only name types for annotations (e.g.
`config_rules` annotates with the `AsyncGRPOConfig` of the `config` module that imports it). Dynamic
imports (`importlib.import_module`, as the package face's lazy attributes use) are not seen.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "asyncgrpo"
DOC = ROOT / "docs" / "architecture.md"
LAYERS_MARKER = "Layers, top first:"


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` (a module) imports `target` (a module), at `path`:`line`."""

    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def find_modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `src` (a package is its __init__)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under the body of an `if TYPE_CHECKING:` (its else runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend([node.test, *node.orelse])
        else:
            stack.extend(ast.iter_child_nodes(node))


def _owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """`name` itself if it is one of `modules`, else its longest prefix that is (None outside them)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, modules: dict[str, Path]) -> list[Import]:
    """The imports of `module` that run (TYPE_CHECKING blocks aside), resolved to modules of `modules`."""
    path = modules[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself (its face)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            target = _owning_module(name, modules)
            if target is not None and target != module:
                found.append(Import(module, target, path, node.lineno))
    return sorted(set(found), key=lambda imp: (imp.line, imp.target))  # one per target and line


def unit_of(module: str, modules: dict[str, Path]) -> str:
    """The layering unit of a module: `pkg/` for anything in a subpackage, the module's name for a
    top-level module, `__init__` for the package face."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if len(parts) > 2 or modules[module].name == "__init__.py":
        return parts[1] + "/"
    return parts[1]


def documented_layers(doc: Path = DOC) -> list[list[str]]:
    """The units of each layer, top first, from the doc's paragraph that starts with LAYERS_MARKER."""
    paragraphs = re.split(r"\n\s*\n", doc.read_text())
    found = [p for p in paragraphs if p.lstrip().startswith(LAYERS_MARKER)]
    assert len(found) == 1, f"{doc} must hold exactly one paragraph starting with {LAYERS_MARKER!r}"
    text = " ".join(found[0].split())[len(LAYERS_MARKER):]
    layers = [re.findall(r"`([^`]+)`", chunk) for chunk in text.split(" > ")]
    assert all(layers), f"an empty layer in {doc}'s {LAYERS_MARKER!r} paragraph: {found[0]!r}"
    return layers


def all_imports(modules: dict[str, Path]) -> list[Import]:
    return [imp for module in modules for imp in imports_of(module, modules)]


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


# ------------------------------------------------------------------------------------- the source tree


def test_the_documented_layers_name_every_package_and_top_level_module_once():
    modules = find_modules(SRC, PACKAGE)
    layers = documented_layers()
    named = [unit for layer in layers for unit in layer]
    repeated = sorted({unit for unit in named if named.count(unit) > 1})
    actual = {unit_of(module, modules) for module in modules}
    missing, unknown = sorted(actual - set(named)), sorted(set(named) - actual)
    assert not (repeated or missing or unknown), (
        f"docs/architecture.md's {LAYERS_MARKER!r} paragraph must name every package (`pkg/`) and top-level "
        f"module of src/{PACKAGE} exactly once: missing {missing}, not in src {unknown}, repeated {repeated}"
    )


def test_every_import_points_to_a_lower_layer():
    modules = find_modules(SRC, PACKAGE)
    layers = documented_layers()
    depth = {unit: i for i, layer in enumerate(layers) for unit in layer}  # 0 is the top
    wrong = []
    for imp in all_imports(modules):
        source, target = unit_of(imp.source, modules), unit_of(imp.target, modules)
        if source == target or source not in depth or target not in depth:
            continue  # inside one unit; an undocumented unit fails the test above
        if depth[target] <= depth[source]:
            where = "in its own layer" if depth[target] == depth[source] else "in a layer above it"
            wrong.append(f"{imp.where()}: `{source}` imports `{target}` ({imp.target}), {where}")
    assert not wrong, (
        "imports against the layering of docs/architecture.md (each unit imports only lower layers; move the "
        "shared code down, e.g. what describes a model into modeling/, or change the documented order if it "
        "is wrong):\n" + "\n".join(wrong)
    )


def test_no_two_packages_import_each_other():
    modules = find_modules(SRC, PACKAGE)
    edges: dict[tuple[str, str], Import] = {}
    for imp in all_imports(modules):
        pair = (unit_of(imp.source, modules), unit_of(imp.target, modules))
        if pair[0] != pair[1]:
            edges.setdefault(pair, imp)
    both = [(a, b) for a, b in edges if a < b and (b, a) in edges]
    assert not both, "units that import each other:\n" + "\n".join(
        f"`{a}` ({edges[a, b].where()}) <-> `{b}` ({edges[b, a].where()})" for a, b in both
    )


def test_no_module_is_part_of_an_import_cycle():
    modules = find_modules(SRC, PACKAGE)
    imports = all_imports(modules)
    cycles = import_cycles(imports)
    lines = []
    for cycle in cycles:
        members = set(cycle)
        edges = [imp for imp in imports if imp.source in members and imp.target in members]
        where = ", ".join(f"{imp.where()} imports {imp.target}" for imp in edges)
        lines.append(" <-> ".join(cycle) + ": " + where)
    assert not cycles, "import cycles outside TYPE_CHECKING blocks:\n" + "\n".join(lines)


# ------------------------------------------------------------------------------------- the reader itself


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_reader_sees_function_level_relative_and_face_imports_and_skips_type_checking(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "Name = 1\n",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": (
            "from typing import TYPE_CHECKING\n"
            "import typing\n"
            "if TYPE_CHECKING:\n"
            "    from pkg.high import b\n"
            "if typing.TYPE_CHECKING:\n"
            "    import pkg.top\n"
            "else:\n"
            "    import pkg.top\n"
            "def f():\n"
            "    from ..high.b import g\n"
            "    from . import c\n"
            "    from pkg import Name\n"
        ),
        "pkg/low/c.py": "",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low import a\n",
        "pkg/top.py": "import os\n",
    })
    modules = find_modules(tmp_path, "pkg")
    seen = sorted((imp.target, imp.line) for imp in imports_of("pkg.low.a", modules))
    assert seen == [("pkg", 12), ("pkg.high.b", 10), ("pkg.low.c", 11), ("pkg.top", 8)]
    assert {unit_of(m, modules) for m in modules} == {"__init__", "low/", "high/", "top"}
    cycles = import_cycles(all_imports(modules))
    assert cycles == [["pkg.high.b", "pkg.low.a"]]  # the function-level import closes it


def test_the_documented_layers_are_read_top_first(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"Intro.\n\n{LAYERS_MARKER} `cli` > `train/`, `evaluate`\n> `types`.\n\nMore.\n")
    assert documented_layers(doc) == [["cli"], ["train/", "evaluate"], ["types"]]
