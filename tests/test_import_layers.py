"""The import layers hold: import-linter's contracts (pyproject.toml) and the measured graph of the units."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import import_layers  # noqa: E402


def test_every_import_linter_contract_is_kept() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "lint-imports is missing: install the dev extra"
    result = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_units_form_at_most_nine_layers_with_no_loop_between_folders() -> None:
    report = import_layers.measure(ROOT)
    assert report["unit_loops"] == []
    assert report["module_loops_across_folders"] == []
    assert report["layers"] <= 9, report["unit_layers"]


def test_no_module_is_over_500_lines_and_no_class_over_400() -> None:
    report = import_layers.measure(ROOT)
    assert report["modules_over_500"] == []
    assert report["classes_over_400"] == []
