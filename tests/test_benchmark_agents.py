"""The agents benchmark: its arithmetic on a hand-made result, and its quick configuration end to end
(every scriptable agent once, through a real ``serve``), rendered as its report section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

agents = load_benchmark("agents")


def turn(started_at: float, proxy_ms: float) -> dict:
    return {"metadata": {"started_at": started_at, "timings": {"proxy_ms": proxy_ms}}}


def test_start_up_is_the_first_calls_arrival_less_the_phases_before_the_agent() -> None:
    result = {
        "phase_seconds": {"capture_session": 0.1, "sandbox_start": 0.4, "install": 0.5, "agent": 9.0},
        "trace": {"turns": [turn(1012.0, 0.5), turn(1011.0, 1.5)]},
    }
    assert agents.startup_s(1000.0, result) == pytest.approx(10.0)  # 1011 - 1000 - (0.1 + 0.4 + 0.5)
    assert agents.proxy_ms(result) == [0.5, 1.5]
    assert agents.startup_s(1000.0, {"trace": {"turns": []}}) is None  # no call, no start-up


def test_an_agents_summary_is_its_medians_and_its_worst_start_up() -> None:
    rows = [
        {"startup_s": s, "proxy_ms": [1.0], "agent_s": 5.0, "model_calls": 2, "reward": r, "error": None}
        for s, r in ((1.0, 1.0), (3.0, 1.0), (2.0, 0.0))
    ]
    summary = agents.summary(rows, 4.5)
    assert (summary["startup_s"], summary["startup_worst_s"], summary["solved"]) == (2.0, 3.0, 2)
    assert summary["proxy_cpu_ms_per_call"] == 4.5 and summary["proxy_ms_per_call"] == 1.0


@pytest.mark.slow
def test_quick_agents_benchmark_runs_every_scriptable_agent_and_leaves_nothing(tmp_path: Path) -> None:
    from harness_trainer.devloop.solver import SCRIPTED_HARNESSES

    out = tmp_path / "result.json"
    run = run_quick(BENCHMARKS / "agents.py", out, 600, "the quick agents benchmark")

    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    assert set(result["agents"]) == set(SCRIPTED_HARNESSES)
    for name, measured in result["agents"].items():
        assert measured["solved"] == 1, (name, measured)
        assert measured["startup_s"] is not None and 0 < measured["startup_s"] < measured["agent_s"], name
        assert measured["proxy_cpu_ms_per_call"] > 0, name
    assert result["leftover_processes"] == [] and result["all_pass"]
