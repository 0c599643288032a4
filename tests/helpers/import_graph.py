"""The import graph of a source tree, and its import circles (strongly connected components of two modules or more).

Every import statement counts: at module level, under ``if TYPE_CHECKING:`` and inside a function. An edge goes to
a module of the tree only; ``from pkg import sub`` is an edge to ``pkg.sub`` alone when ``sub`` is a module, and to
``pkg`` when a name imported is not a module of it.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_files(src: Path) -> dict[str, Path]:
    """Module name -> its file, for every ``.py`` under ``src`` (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name of what ``from X import ...`` names as X (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = _imported_from(node, module, path.name == "__init__.py")
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            targets.update(subs)
            if base in modules and len(subs) < len(node.names):
                targets.add(base)
    targets.discard(module)
    return targets


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``src`` it imports."""
    modules = module_files(src)
    return {module: _targets(module, path, modules) for module, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: each set of two or more modules that all reach each other, sorted by their first name."""
    reach = {module: _reachable(graph, module) for module in graph}
    found = {frozenset(m for m in reach[module] if module in reach[m]) for module in graph}
    return sorted((c for c in found if len(c) > 1), key=sorted)
