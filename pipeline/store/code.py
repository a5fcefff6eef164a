"""The code a stage runs: the package's import graph, read from the source (nothing is imported).

A stage's cache key hashes the files of its module's import closure within `pipeline` (every import
statement counts, top-level or inside a function), so an edit anywhere a stage can reach rebuilds it and
an edit elsewhere does not. The same graph is what the import-cycle test walks.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from pipeline import paths

PACKAGE = "pipeline"


def module_path(name: str) -> Path | None:
    """The file of module `name` (a package is its __init__.py); None if it is not in the package."""
    base = paths.ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def module_name(path: Path) -> str:
    rel = path.resolve().relative_to(paths.ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def all_modules() -> list[str]:
    return sorted(module_name(p) for p in (paths.ROOT / PACKAGE).rglob("*.py"))


@functools.lru_cache(maxsize=None)
def imports(name: str) -> frozenset[str]:
    """The package modules that module `name` imports (`from a.b import c` is a.b.c when c is a module)."""
    path = module_path(name)
    if path is None:
        return frozenset()
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{a.name}" if module_path(f"{node.module}.{a.name}") else node.module
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t.split(".")[0] == PACKAGE and module_path(t))
    out.discard(name)
    return frozenset(out)


def closure(name: str) -> list[str]:
    """`name` and every package module it reaches through imports, sorted."""
    seen, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m))
    return sorted(seen)


def cycles() -> list[list[str]]:
    """Import cycles among the package's modules (each as a path that returns to its start)."""
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(imports(m)):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in all_modules():
        if m not in state:
            visit(m)
    return found
