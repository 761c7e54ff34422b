"""Shared by the benchmark tests: a benchmark script loaded as a module, and a run of one as a subprocess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[1]
BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded from its path as module ``benchmark_<name>``, for its constants and
    functions."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def run_to_end(
    command: list[str], timeout_s: float, what: str, stop_s: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in the repository root, its stderr merged into its stdout. Past ``timeout_s`` it gets
    one SIGTERM (on which a benchmark stops its servers, and their sandboxes, before it exits), ``stop_s``
    to end, and the test fails with the end of its output, saying ``what`` took too long."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.terminate()
        stdout, _ = process.communicate(timeout=stop_s)
        pytest.fail(f"{what} took over {timeout_s:g} s:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, "")


def run_quick(
    script: Path, out: Path, timeout_s: float, what: str, stop_s: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """``python <script> --quick --json <out>`` run to its end by :func:`run_to_end`; when it succeeded, its
    JSON result also renders as its section of ``python -m benchmarks``'s report (so the report's own test
    need not run every benchmark again)."""
    run = run_to_end([sys.executable, str(script), "--quick", "--json", str(out)], timeout_s, what, stop_s)
    if run.returncode == 0 and out.is_file():
        check_section(script.stem, json.loads(out.read_text()))
    return run


def check_section(name: str, result: dict) -> None:
    """Benchmark ``name``'s real ``result`` makes a report section with a headline, rows and verdicts,
    and a Markdown rendering that names it."""
    from benchmarks import report

    section = report.section(name, result, seconds=1.0)
    assert not section.error and section.headline and section.rows and section.verdicts, name
    assert f"## {name}: " in report.render_section(section), name
