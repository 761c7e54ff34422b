"""Measure the import graph: layers of units, imports that run back up, loops, and module and class sizes.

A unit is each top-level folder of ``harness_trainer/`` and each top-level module there, plus
``capture_proxy`` and ``benchmarks`` as one unit each. A unit stands one layer above everything it
imports (every ``import`` statement counts, lazy ones inside functions too, ``TYPE_CHECKING`` ones not).
Units in an import loop share a layer; an import inside such a loop that points from a lower unit to a
higher one is reported as running back up. Run from the repository root: ``python scripts/import_layers.py``.
"""

from __future__ import annotations

import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOTS = ("harness_trainer", "capture_proxy", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, name: str, is_package: bool, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_type_checking(node):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "harness_trainer" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def measure(root: Path) -> dict:
    files = {
        module_name(p.relative_to(root)): p
        for r in ROOTS
        for p in (root / r).rglob("*.py")
        if "examples/tasks" not in p.as_posix()
    }
    known = set(files)
    modules = {m: imports_of(p, m, p.name == "__init__.py", known) for m, p in files.items()}
    units: dict[str, set[str]] = defaultdict(set)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, targets in modules.items():
        units[unit_of(module)]
        for target in targets:
            a, b = unit_of(module), unit_of(target)
            # A package's __init__ importing its own children is not a dependency of the unit on itself.
            if a != b and not (a == "harness_trainer" and module == "harness_trainer"):
                units[a].add(b)
                edges[(a, b)].append(f"{module} -> {target}")
    components = strongly_connected(units)
    comp_of = {u: i for i, c in enumerate(components) for u in c}
    layer: dict[int, int] = {}
    for i, component in enumerate(components):  # Tarjan emits components in reverse topological order
        below = [layer[comp_of[t]] for u in component for t in units[u] if comp_of[t] != i]
        layer[i] = 1 + max(below, default=0)
    module_loops = [c for c in strongly_connected(modules) if len(c) > 1]
    folder = {m: m if p.name == "__init__.py" else m.rpartition(".")[0] for m, p in files.items()}
    cross_loops = [c for c in module_loops if len({folder[m] for m in c}) > 1]
    unit_loops = [c for c in components if len(c) > 1]
    back = [line for c in unit_loops for a in c for b in units[a] if b in c for line in edges[(a, b)]]
    sizes = {m: len(p.read_text().splitlines()) for m, p in files.items()}
    classes = []
    for m, p in files.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{m}.{node.name}"))
    return {
        "layers": max(layer.values()),
        "unit_layers": {u: layer[comp_of[u]] for u in sorted(units)},
        "unit_loops": unit_loops,
        "imports_in_unit_loops": back,
        "module_loops": module_loops,
        "module_loops_across_folders": cross_loops,
        "modules_over_500": sorted([(n, m) for m, n in sizes.items() if n > 500], reverse=True),
        "classes_over_400": sorted([c for c in classes if c[0] > 400], reverse=True),
        "largest_folder": max(
            (sum(1 for p in files.values() if p.parent == parent), parent.relative_to(root).as_posix())
            for parent in {p.parent for p in files.values()}
        ),
    }


if __name__ == "__main__":
    report = measure(Path.cwd())
    if "--json" in sys.argv:
        print(json.dumps(report, indent=1))
    else:
        print(f"layers: {report['layers']}")
        for unit, n in sorted(report["unit_layers"].items(), key=lambda kv: (kv[1], kv[0])):
            print(f"  {n:2d} {unit}")
        print(f"unit loops: {report['unit_loops']}")
        print("imports inside unit loops:", *report["imports_in_unit_loops"], sep="\n  ")
        print(f"module loops: {len(report['module_loops'])}", *report["module_loops"], sep="\n  ")
        print(f"module loops across folders: {len(report['module_loops_across_folders'])}")
        print("modules over 500 lines:", *report["modules_over_500"], sep="\n  ")
        print("classes over 400 lines:", *report["classes_over_400"], sep="\n  ")
        print("largest folder:", report["largest_folder"])
