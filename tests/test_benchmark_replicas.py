"""The replicas benchmark runs end to end in its quick configuration, reports both targets, and its result
renders as its section of the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_replicas = load_benchmark("replicas")


@pytest.mark.slow
def test_quick_replicas_benchmark_reports_both_targets(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "replicas.py", out, 180, "the quick replicas benchmark", stop_s=30)

    assert run.returncode == 0, run.stdout[-4000:]
    for name in benchmark_replicas.TARGET_NAMES:
        assert any(
            line.split()[:1] in (["PASS"], ["MISS"]) and name in line for line in run.stdout.splitlines()
        )
    result = json.loads(out.read_text())
    assert result["throughput"]["ratio"] > 0 and "added_p50_ms" in result["latency"]
    assert len(result["throughput"]["samples"]["replicas"]) == 1
