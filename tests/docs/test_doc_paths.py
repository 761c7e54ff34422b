"""Every file path and Python name the docs give exists in the tree: a move that leaves a doc behind fails.

The docs are the READMEs, ``docs/*.md`` and the examples' READMEs. A path in backticks
(``trainer/step/rows.py``) must be a file of the repository, relative to its root or written from inside a
package (the tail of a tracked file's path); a dotted name (``harness_trainer.trainer.step.loss.policy_loss``)
must import, with each name after the module an attribute of it.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/README.md")])
PATH = re.compile(r"`([\w./-]+\.(?:py|md|yaml|yml|sh|jinja|toml|json))`")
DOTTED = re.compile(r"(?<![\w./-])((?:harness_trainer|capture_proxy|benchmarks)(?:\.\w+)+)")
EXTENSIONS = {"py", "md", "yaml", "yml", "sh", "jinja", "toml", "json", "jsonl", "html", "png"}


@cache
def tracked() -> tuple[str, ...]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return tuple(listed.stdout.split())


def path_exists(path: str) -> bool:
    """A bare file name other than a module's (``run_config.json``, ``mini.yaml``) is often a run's output or
    another package's file: only names with a folder, and modules, must be in the tree."""
    if (ROOT / path).exists() or ("/" not in path and not path.endswith(".py")):
        return True
    if any(part.isupper() for part in path.split("/")):  # a placeholder: OUTPUT_DIR/run_config.json
        return True
    return any(name == path or name.endswith("/" + path) for name in tracked())


def module_exists(parts: list[str]) -> bool:
    return (ROOT.joinpath(*parts).with_suffix(".py")).is_file() or (
        ROOT.joinpath(*parts) / "__init__.py"
    ).is_file()


def name_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    cut = max(n for n in range(1, len(parts) + 1) if module_exists(parts[:n]))
    if cut == len(parts):
        return True
    obj = importlib.import_module(".".join(parts[:cut]))
    for attribute in parts[cut:]:
        if not hasattr(obj, attribute):
            return False
        obj = getattr(obj, attribute)
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_is_a_file_of_the_tree(doc: Path) -> None:
    text = doc.read_text()
    missing = sorted({p for p in PATH.findall(text) if "*" not in p and not path_exists(p)})
    assert missing == [], f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_name_a_doc_gives_exists(doc: Path) -> None:
    text = doc.read_text()
    names = {d.rstrip(".") for d in DOTTED.findall(text)}
    missing = sorted(d for d in names if d.rpartition(".")[2] not in EXTENSIONS and not name_exists(d))
    assert missing == [], f"{doc.relative_to(ROOT)} names modules or attributes that do not exist: {missing}"
