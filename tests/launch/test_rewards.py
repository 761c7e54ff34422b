"""The launcher's reward: verifier correctness, plus a small tool-efficiency bonus only for a solve."""

from __future__ import annotations

import pytest

from harness_trainer.launch.rewards import correctness_with_tool_efficiency
from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome, apply_reward_fn


def outcome(env_reward: float | None, tool_calls: int = 0) -> HarnessRolloutOutcome:
    return HarnessRolloutOutcome(
        env_reward=env_reward,
        completion=[],
        trace=[],
        tool_call_count=tool_calls,
        tool_failure_count=0,
        tool_calls_by_name={"bash": tool_calls} if tool_calls else {},
        timed_out=False,
    )


@pytest.mark.parametrize(("tool_calls", "expected"), [(0, 1.1), (1, 1.095), (10, 1.05), (20, 1.0), (35, 1.0)])
def test_a_solve_earns_a_bonus_that_shrinks_with_tool_calls(tool_calls: int, expected: float) -> None:
    assert correctness_with_tool_efficiency(outcome(1.0, tool_calls)) == pytest.approx(expected)


@pytest.mark.parametrize("env_reward", [0.0, 0.5, 0.99])
def test_an_unsolved_task_earns_no_bonus_even_without_tool_calls(env_reward: float) -> None:
    assert correctness_with_tool_efficiency(outcome(env_reward, 0)) == env_reward


def test_an_ungraded_rollout_stays_unscored() -> None:
    assert correctness_with_tool_efficiency(outcome(None, 2)) is None


def test_the_trainer_accepts_what_it_returns() -> None:
    assert apply_reward_fn(outcome(1.0, 4), correctness_with_tool_efficiency) == pytest.approx(1.08)
    assert apply_reward_fn(outcome(None), correctness_with_tool_efficiency) is None
