"""The trainer benchmark runs end to end in its quick configuration and reports every variant, measure and
target (whether the targets pass is the benchmark's business, not this test's)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "trainer.py"
# Loaded from its path for its constants: the repository root is not on sys.path under `pytest`.
_SPEC = importlib.util.spec_from_file_location("benchmark_trainer", SCRIPT)
assert _SPEC is not None and _SPEC.loader is not None
benchmark_trainer = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = benchmark_trainer  # dataclasses look their module up while the class is built
_SPEC.loader.exec_module(benchmark_trainer)


@pytest.mark.slow
def test_quick_trainer_benchmark_reports_both_parts_and_every_target(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    lines = run.stdout.splitlines()
    for variant in benchmark_trainer.VARIANTS:
        assert any(line.startswith(f"{variant} ") for line in lines), variant
    assert any("ms per million trace input tokens" in line for line in lines)
    for name in benchmark_trainer.TARGET_NAMES:
        assert any(line.split()[:1] in (["PASS"], ["MISS"]) and name in line for line in lines), name

    result = json.loads(out.read_text())
    variants = result["packing"]["variants"]
    assert list(variants) == list(benchmark_trainer.VARIANTS)
    for variant in variants.values():
        assert variant["tps"]["median"] > 0 and variant["trained_tokens"] > 0
    # Every variant trains the same rows; packing forwards no padding, padding forwards more.
    assert len({variant["trained_tokens"] for variant in variants.values()}) == 1
    assert variants["packed"]["tensor_tokens"] == result["packing"]["workload"]["tokens"]
    assert variants["padded"]["tensor_tokens"] >= variants["packed"]["tensor_tokens"]
    assert variants["padded"]["vs_padded"]["median"] == pytest.approx(1.0)
    rows = result["rows"]
    assert rows["traces"] == 2 and rows["turns"] == 50
    assert rows["forwarded_tokens"] >= rows["unique_tokens"] > 0
    assert rows["input_tokens"] > rows["unique_tokens"]
    assert rows["ms_per_million_input"] > 0 and rows["ms_per_million_unique"] > 0
    assert [v["target"] for v in result["verdicts"]] == list(benchmark_trainer.TARGET_NAMES)
    assert isinstance(result["all_pass"], bool)
