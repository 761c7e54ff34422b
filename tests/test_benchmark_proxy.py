"""The proxy benchmark runs end to end in its quick configuration, reports every row, column and target,
and leaves none of its servers behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_proxy = load_benchmark("proxy")

POINTS = ("c1 json", "c1 sse", "c4 json", "c4 sse", "paced c4 sse")
SAMPLE_FIELDS = {"rps", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "vs_passthrough", "repeats"}
MEMORY_FIELDS = {"per_session_mb", "rss_before_mb", "rss_finished_mb", "trace_export_ms", "trace_chains"}


@pytest.mark.slow
def test_quick_proxy_benchmark_reports_every_target_and_stops_its_servers(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "proxy.py", out, 120, "the quick benchmark", stop_s=30)

    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("point "))
    assert header.split("  ") and all(column in header for column in benchmark_proxy.COLUMNS)
    for point in POINTS:
        for target in benchmark_proxy.TARGETS:
            assert any(line.startswith(f"{point} ") and f" {target} " in line for line in lines), (
                point,
                target,
            )
    for name in benchmark_proxy.TARGET_NAMES:
        assert any(line.split()[:1] in (["PASS"], ["MISS"]) and name in line for line in lines), name

    result = json.loads(out.read_text())
    assert set(result["points"]) == set(POINTS)
    proxy = result["points"]["c4 json"]["targets"]["proxy"]
    assert SAMPLE_FIELDS | {"cpu_ms_per_request", "peak_rss_mb"} <= set(proxy)
    assert SAMPLE_FIELDS <= set(result["points"]["c1 sse"]["targets"]["direct"])
    assert proxy["rps"] > 0 and proxy["p99_ms"] >= proxy["p50_ms"] > 0
    assert MEMORY_FIELDS <= set(result["memory"]) and result["memory"]["trace_chains"]
    assert [v["target"] for v in result["verdicts"]] == list(benchmark_proxy.TARGET_NAMES)
    assert isinstance(result["all_pass"], bool) and result["elapsed_s"] > 0
    for pid in result["server_pids"]:  # every server it started is gone (terminated and reaped)
        assert not Path(f"/proc/{pid}").exists(), pid
