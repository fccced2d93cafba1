"""The benchmarks name only what the package has: many of their branches run on a GPU alone, where a
renamed function would first fail after minutes of set-up (bench/decode_step.py once called a
decode-attention check under a name the module no longer had)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def package_names(tree: ast.Module) -> tuple[dict[str, object], list[str]]:
    """(local name -> imported asyncgrpo module, imported names the package lacks), over every import
    of the file, those inside functions included."""
    modules, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "asyncgrpo":
            parent = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(parent, alias.name, None)
                if value is None:
                    try:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                        continue
                if isinstance(value, type(importlib)):
                    modules[alias.asname or alias.name] = value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "asyncgrpo" and alias.asname:
                    modules[alias.asname] = importlib.import_module(alias.name)
    return modules, missing


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_benchmark_names_exist_in_the_package(script):
    tree = ast.parse((BENCH / script).read_text())
    modules, missing = package_names(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and not hasattr(modules[node.value.id], node.attr)):
            missing.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not missing, f"bench/{script} names what asyncgrpo does not have: {missing}"
