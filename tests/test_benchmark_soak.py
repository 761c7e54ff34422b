"""The soak benchmark runs end to end in its quick configuration, reports every wave, process and target,
ran its leak checks, and leaves no server behind (whether the targets pass is the benchmark's business)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_soak = load_benchmark("soak")

PROCESS_FIELDS = {"rss_mb_start", "rss_mb_end", "fds_start", "fds_end", "threads_start", "threads_end"}
PROCESS_FIELDS |= {"rss_slope_mb_per_100", "samples"}
END_FIELDS = {"sessions", "capture_sessions", "sandboxes", "data_dir_bytes", "data_dir_sessions"}
END_FIELDS |= {"server_children"}


@pytest.mark.slow
def test_quick_soak_reports_every_wave_and_leak_check_and_leaves_nothing_running(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "soak.py", out, 120, "the quick soak", stop_s=90)

    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["wave", "rollouts"])
    assert all(column in header for column in benchmark_soak.COLUMNS)
    for name in benchmark_soak.TARGET_NAMES:
        assert any(line.split()[:1] in (["PASS"], ["MISS"]) and name in line for line in lines), name

    result = json.loads(out.read_text())
    config = result["config"]
    waves = result["waves"]
    counted = [wave for wave in waves if wave["counted"]]
    assert not waves[0]["counted"] and len(counted) >= 3  # a warm-up, then enough waves for a slope
    assert waves.index(counted[0]) == len(waves) - len(counted)  # every warm-up wave comes first
    assert sum(w["rollouts"] for w in waves if not w["counted"]) == config["warmup"]
    assert sum(w["rollouts"] for w in counted) == result["counted_rollouts"] == config["rollouts"]
    for wave in waves:
        assert wave["calls"] == wave["rollouts"] * config["steps"]  # every rollout made its calls
        assert wave["bytes_per_call"] > 0
        assert wave["server"]["rss_mb"] > 0 and wave["server"]["fds"] > 0 and wave["engine"]["rss_mb"] > 0
        assert wave["proxy"]["rss_mb"] > 0 and wave["proxy"]["fds"] > 0  # serve's proxy child, watched too
    for name in ("server", "proxy", "engine"):  # the leak checks ran on every long-lived process
        process = result["processes"][name]
        assert PROCESS_FIELDS <= set(process)
        assert process["samples"] > len(counted) and process["rss_slope_mb_per_100"] is not None
    journal = result["journal"]
    assert journal["calls"] == config["rollouts"] * config["steps"]
    assert journal["written_bytes"] > 0 and journal["expected_bytes"] > 0 and journal["max_deviation"] >= 0
    assert END_FIELDS <= set(result["end"])
    assert result["end"]["server_children"] == 0  # the proxy child is part of the server, not a leftover
    assert result["failures"] == [] and result["leftover_processes"] == []
    assert [v["target"] for v in result["verdicts"]] == list(benchmark_soak.TARGET_NAMES)
    assert isinstance(result["all_pass"], bool) and result["elapsed_s"] > 0
    for pid in result["pids"]:  # the engine and the server are gone (terminated and reaped)
        assert not Path(f"/proc/{pid}").exists(), pid


def test_waves_warm_up_first_then_count_every_rollout_asked() -> None:
    assert benchmark_soak.wave_plan(10, 4, 5) == [
        ("warm-up 1", 4, False),
        ("warm-up 2", 1, False),
        ("1", 4, True),
        ("2", 4, True),
        ("3", 2, True),
    ]


def test_slope_is_a_least_squares_fit_per_100_rollouts() -> None:
    samples = [{"done": done, "server": {"rss_mb": 50 + 0.02 * done}} for done in range(0, 200, 10)]
    samples.append({"done": 300})  # a sample without the process (it had ended) is skipped

    assert benchmark_soak.slope_per_100(samples, "server") == pytest.approx(2.0)
    assert benchmark_soak.slope_per_100(samples[:1], "server") is None
    assert benchmark_soak.slope_per_100([{"done": 5, "server": {"rss_mb": 1.0}}] * 3, "server") is None
