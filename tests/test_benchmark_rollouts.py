"""The rollout benchmark runs end to end in its quick configuration, reports every row and the target, and
leaves no server, agent or sandbox process behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_rollouts = load_benchmark("rollouts")

ROWS = ("raw agent (2 calls)", "rollout (2 calls)", "overhead (rollout - raw)", "8 sessions")
PARTS = ("capture_session", "sandbox_start", "install", "agent - raw", "upload", "verifier", "trace")
PARTS += ("cleanup", "rest")
POINT_FIELDS = {"held", "failed", "cpu_pct_core", "cpu_pct_machine", "calls_per_s", "cpu_ms_per_call"}
POINT_FIELDS |= {"rss_mb", "threads", "ramp_s", "drain_s", "wall_s", "limit", "ok", "agents_after"}
POINT_FIELDS |= {"ramp_cpu_ms_per_session", "drain_cpu_ms_per_session", "drain_phases_s"}
POINT_FIELDS |= {"proxy_process", "proxy_cpu_pct_core"}


@pytest.mark.slow
def test_quick_rollout_benchmark_reports_every_row_and_leaves_nothing_running(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "rollouts.py", out, 90, "the quick benchmark", stop_s=90)

    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("row "))
    assert all(column in header for column in benchmark_rollouts.COLUMNS)
    for row in ROWS + tuple(f"  {part} " for part in PARTS):
        assert any(line.startswith(row) for line in lines), row
    assert any(
        line.split()[:1] in (["PASS"], ["MISS"]) and benchmark_rollouts.TARGET_NAME in line for line in lines
    )

    result = json.loads(out.read_text())
    assert result["raw"]["median_s"] > 0 and result["rollout"]["median_s"] > 0
    assert len(result["rollout"]["runs_s"]) == 2 and isinstance(result["serial_failures"], list)
    assert list(result["overhead_parts_s"]) == list(PARTS)
    parts = sum(result["overhead_parts_s"].values())
    assert parts == pytest.approx(result["overhead_s"])  # the parts add up to the overhead
    (point,) = result["points"]
    assert POINT_FIELDS <= set(point)
    assert point["sessions"] == 8 and point["held"] <= 8 and point["limit"] == ""
    # The server itself may idle through a short window (its proxy child answers the calls), and /proc
    # counts CPU in 10 ms ticks, so its share can read 0; the proxy's cannot while calls flow.
    assert point["calls_per_s"] > 0 and point["cpu_pct_core"] >= 0 and point["agents_after"] == 0
    assert point["proxy_process"] and point["proxy_cpu_pct_core"] > 0  # serve's proxy child, measured apart
    assert result["verdict"]["target"] == benchmark_rollouts.TARGET_NAME and not result["verdict"]["pass"]
    assert result["leftover_processes"] == []
    for pid in result["pids"]:  # every engine and server it started is gone (terminated and reaped)
        assert not Path(f"/proc/{pid}").exists(), pid
