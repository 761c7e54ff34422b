"""The trainer benchmark runs end to end in its quick configuration and reports every variant, measure and
target (whether the targets pass is the benchmark's business, not this test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_trainer = load_benchmark("trainer")


@pytest.mark.slow
def test_quick_trainer_benchmark_reports_both_parts_and_every_target(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "trainer.py", out, 180, "the quick benchmark", stop_s=30)

    assert run.returncode == 0, run.stdout[-4000:]
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
