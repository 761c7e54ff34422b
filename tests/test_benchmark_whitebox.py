"""The white-box vs black-box benchmark: its arithmetic on hand-made metrics and rollout records, its report
section, and its quick configuration run for real (two dev loops)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import report
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_to_end

whitebox = load_benchmark("whitebox")


def test_rollouts_per_minute_count_the_steps_after_the_first_over_their_span() -> None:
    steps = [
        {"step": 2, "time": 130.0, "rollout/count": 4.0},
        {"step": 1, "time": 100.0, "rollout/count": 4.0},  # its start-up is left out, as its rollouts
        {"step": 3, "time": 160.0, "rollout/count": 2.0},
    ]
    assert whitebox.rollouts_per_minute(steps) == pytest.approx(60.0 * 6 / 60.0)
    assert whitebox.rollouts_per_minute(steps[:1]) is None  # one step: no span
    assert whitebox.rollouts_per_minute([{"step": 1, "time": 5.0}, {"step": 2, "time": 5.0}]) is None


def turn(completion: int) -> dict:
    return {"completion_token_ids": list(range(completion))}


def test_rollout_measures_take_the_rollouts_a_step_took_and_their_turns() -> None:
    records = [
        {"step": 1, "advantage": 0.5, "seconds": 10.0, "llm_s": 4.0, "trace": {"turns": [turn(3), turn(5)]}},
        {"step": 1, "advantage": None, "seconds": 3.0, "llm_s": 2.0, "trace": {"turns": [turn(4)]}},
        {"step": None, "seconds": 99.0, "llm_s": 0.0, "trace": {"turns": [turn(50)]}},  # not taken
        {"step": 2, "advantage": 1.0, "seconds": 5.0, "llm_s": 0.0, "trace": None},  # no trace logged
    ]
    measures = whitebox.rollout_measures(records)
    assert measures["trained_tokens_per_rollout"] == pytest.approx((8 + 4) / 2)
    assert measures["outside_engine_s_per_turn"] == pytest.approx((6.0 / 2 + 1.0 / 1) / 2)
    assert measures["llm_s_per_turn"] == pytest.approx((2.0 + 2.0) / 2)
    assert (measures["turns_per_rollout"], measures["trained_rollouts"]) == (1.5, 2.0)
    assert whitebox.rollout_measures(records[2:]) == {}


def test_ratios_are_white_over_black_and_missing_where_either_is() -> None:
    runs = {
        "black-box": {"rollouts_per_min": 10.0, "trained_tokens_per_rollout": 100.0},
        "white-box": {"rollouts_per_min": 25.0, "trained_tokens_per_rollout": 80.0,
                      "outside_engine_s_per_turn": 0.5},
    }  # fmt: skip
    assert whitebox.ratios(runs) == {
        "rollouts_per_min": 2.5, "trained_tokens_per_rollout": 0.8, "outside_engine_s_per_turn": None,
    }  # fmt: skip


def result() -> dict:
    run = {"rollouts_per_min": 12.0, "trained_tokens_per_rollout": 90.0, "outside_engine_s_per_turn": 2.0,
           "llm_s_per_turn": 1.0, "turns_per_rollout": 3.0, "steps": 8, "reward": [0.5, 1.0],
           "seconds": 600.0}  # fmt: skip
    white = {**run, "rollouts_per_min": 18.0, "outside_engine_s_per_turn": 0.5}
    return {
        "config": {"steps": 8, "seed": 0, "quick": False, "black_box_agent": "mini-swe-agent"},
        "runs": {"black-box": run, "white-box": white},
        "ratios": whitebox.ratios({"black-box": run, "white-box": white}),
        "verdicts": [],
    }


def test_the_section_reports_each_measure_as_a_ratio_and_sets_no_target() -> None:
    section = report.section("whitebox", result())
    assert [row.ratios for row in section.rows] == [[1.5], [1.0], [0.25]]
    assert section.headline == "white-box 1.50x black-box rollouts per minute" and section.verdicts == []
    assert "## whitebox: " in report.render_section(section)


@pytest.mark.slow
def test_the_quick_benchmark_runs_both_modes_and_measures_each(tmp_path: Path) -> None:
    out = tmp_path / "whitebox.json"
    command = [sys.executable, str(BENCHMARKS / "whitebox.py"), "--quick", "--json", str(out)]
    run = run_to_end(command, 600, "the quick white-box benchmark", stop_s=60)
    assert run.returncode == 0, run.stdout[-4000:]
    measured = json.loads(out.read_text())
    for mode in ("black-box", "white-box"):
        got = measured["runs"][mode]
        assert got["steps"] == 3 and got["rollouts_per_min"] > 0, mode
        assert got["trained_tokens_per_rollout"] > 0 and got["llm_s_per_turn"] > 0, mode
    assert all(value is not None and value > 0 for value in measured["ratios"].values())
    assert report.section("whitebox", measured).rows  # its real result renders too
