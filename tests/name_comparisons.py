"""Finds the comparisons of a value to a registered name written as a string literal (``== "vllm"``,
``in ("toy", ...)``): the facts those names stand for belong on the registered classes."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _literals(node: ast.expr) -> Iterable[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _literals(element)


def name_comparisons(names: Iterable[str], folders: Iterable[str], allowed: Iterable[str]) -> list[str]:
    """``path:line: source`` of each comparison (``==``, ``!=``, ``in``, ``not in``) of anything to one of
    ``names`` as a literal, in the modules under ``folders`` (relative to the repository) other than
    ``allowed`` (paths relative to the repository: a file, or a folder and all below it)."""
    names, skipped = set(names), [ROOT / path for path in allowed]
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(path == skip or skip in path.parents for skip in skipped):
                continue
            source = path.read_text()
            for node in ast.walk(ast.parse(source)):
                if not isinstance(node, ast.Compare):
                    continue
                if not all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
                    continue
                if names & {value for side in [node.left, *node.comparators] for value in _literals(side)}:
                    where = path.relative_to(ROOT)
                    found.append(f"{where}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found
