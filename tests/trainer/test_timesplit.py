"""A rollout's wall time split into model calls, environment and the rest, from hand-made traces."""

from __future__ import annotations

import pytest

from harness_trainer.trainer.step.timesplit import TimeSplit, time_split, union_seconds


def call(start: float | None, end: float | None) -> dict[str, float | None]:
    return {"started_at": start, "finished_at": end}


def test_sequential_calls_add_up_and_the_agent_phase_outside_them_is_environment() -> None:
    turns = [call(100.0, 102.0), call(105.0, 106.0)]
    phases = {"capture_session": 0.1, "sandbox_start": 2.0, "install": 1.0, "agent": 10.0, "verifier": 1.5}
    split = time_split(turns, phases, wall_s=20.0)
    assert split.llm_s == pytest.approx(3.0)
    assert split.env_s == pytest.approx(2.0 + 1.0 + 1.5 + (10.0 - 3.0))
    assert split.other_s == pytest.approx(20.0 - 3.0 - 11.5)


def test_a_white_box_episodes_tool_calls_are_environment() -> None:
    # A white-box environment reports no agent phase: its tools' summed time is the environment's.
    turns = [call(100.0, 102.0), call(104.0, 105.0)]
    phases = {"sandbox_start": 1.0, "tools": 2.5, "upload": 0.2, "verifier": 0.8}
    split = time_split(turns, phases, wall_s=9.0)
    assert (split.llm_s, split.env_s) == (pytest.approx(3.0), pytest.approx(4.5))
    assert split.other_s == pytest.approx(1.5)


def test_concurrent_calls_are_counted_once() -> None:
    turns = [call(0.0, 4.0), call(1.0, 2.0), call(3.0, 6.0), call(10.0, 11.0)]
    assert time_split(turns, {}, wall_s=12.0).llm_s == pytest.approx(7.0)


def test_turns_without_both_stamps_or_running_backwards_are_left_out() -> None:
    turns = [call(0.0, 1.0), call(None, 5.0), call(2.0, None), {}, call(9.0, 8.0), call(float("nan"), 3.0)]
    assert time_split(turns, {}, wall_s=4.0).llm_s == pytest.approx(1.0)


def test_without_phases_the_environment_is_zero_and_the_rest_is_other() -> None:
    assert time_split([call(0.0, 1.5)], {}, wall_s=4.0) == TimeSplit(llm_s=1.5, env_s=0.0, other_s=2.5)


def test_an_errored_rollout_without_a_trace_is_environment_and_other_only() -> None:
    split = time_split([], {"sandbox_start": 3.0, "cleanup": 0.5, "bogus": "x"}, wall_s=5.0)
    assert split == TimeSplit(llm_s=0.0, env_s=3.5, other_s=1.5)


def test_clock_skew_never_makes_other_negative() -> None:
    split = time_split([call(0.0, 10.0)], {"agent": 10.0, "verifier": 2.0}, wall_s=9.0)
    assert split.other_s == 0.0 and split.env_s == pytest.approx(2.0)


def test_union_of_nested_and_touching_intervals() -> None:
    assert union_seconds([(0.0, 10.0), (2.0, 3.0), (10.0, 12.0), None]) == pytest.approx(12.0)
    assert union_seconds([]) == 0.0
