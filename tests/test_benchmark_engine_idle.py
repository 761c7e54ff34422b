"""The engine-idle benchmark's arithmetic: busy intervals merged, pauses counted idle, per step."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

engine_idle = load_benchmark("engine_idle")


def test_busy_intervals_merge_and_each_step_counts_its_idle_part() -> None:
    calls = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (9.0, 9.0)]
    assert engine_idle.merged(calls) == [(0.0, 3.0), (5.0, 6.0)]
    # Step 1: [0, 4], busy 3 s -> idle 0.25. Step 2: [4, 10], busy 1 s, the last 5 s a push (idle).
    assert engine_idle.idle_fractions(calls, [(0.0, 4.0, 0.0), (4.0, 10.0, 0.0)]) == pytest.approx(
        [0.25, 5 / 6]
    )
    # A call that only waited out a push (paused engine) does not count as busy.
    assert engine_idle.idle_fractions([(4.0, 10.0)], [(4.0, 10.0, 3.0)]) == pytest.approx([0.5])
    assert engine_idle.idle_fractions(calls, [(3.0, 3.0, 0.0)]) == []  # an empty step is skipped


def test_the_target_judges_the_worst_steady_step_and_the_median_staleness_of_long_runs_only() -> None:
    run = {"idle": [0.9, 0.5] + [0.05] * 9 + [0.08], "staleness_tokens_median": [0, 0] + [1.0] * 9 + [2.0]}
    idle, staleness = engine_idle.verdicts_for(run, 12)
    assert idle["pass"] and idle["measured"] == "worst 0.08, median 0.05 over 10 steps"
    assert staleness["pass"] and staleness["measured"].startswith("1.00 (per step 1 1")
    run["idle"][5] = 0.11  # one steady step over 10 %
    assert not engine_idle.verdicts_for(run, 12)[0]["pass"]
    run["staleness_tokens_median"] = [0, 0] + [2.0] * 10
    assert not engine_idle.verdicts_for(run, 12)[1]["pass"]
    assert engine_idle.verdicts_for(run, 3) == []  # a quick run is too short to judge
