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


def point(sessions: int, per_call: float | None, *, held: int | None = None) -> dict:
    held = sessions if held is None else held
    return {
        "ok": held == sessions, "sessions": sessions, "held": held, "failed": sessions - held,
        "cpu_pct_core": 3.0, "cpu_pct_machine": 1.5, "calls_per_s": 100.0, "rss_mb": 200.0,
        "cpu_ms_per_call": per_call, "proxy_process": True, "proxy_cpu_pct_core": 16.0, "limit": "",
    }  # fmt: skip


def test_the_verdict_counts_the_server_and_its_proxy_per_model_call() -> None:
    verdict = benchmark_rollouts.verdict
    assert verdict([point(256, 0.5), point(512, 0.9)])["pass"]
    # The server's own CPU is low, but with its proxy a call costs more than 1 ms.
    missed = verdict([point(512, 1.2)])
    assert not missed["pass"] and "1.20 ms of CPU per model call" in missed["measured"]
    assert not verdict([point(512, None)])["pass"]  # no call measured: nothing to judge by
    assert not verdict([point(512, 0.5, held=500)])["pass"]  # not all held
    small = verdict([point(256, 0.5)])
    assert not small["pass"] and "no point of 512" in small["measured"]
