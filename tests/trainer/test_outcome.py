"""HarnessRolloutOutcome as TRL shapes it, and rollout_reward_fn results checked into a reward or an error."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from harness_trainer.rollouts.client.session import VerifyResult
from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.step.outcome import (
    HarnessRolloutOutcome,
    RewardFunctionError,
    apply_reward_fn,
    build_outcome,
)


def tool_call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def make_turn(node_id: str, messages: list[dict[str, Any]], reply: dict[str, Any]) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [3],
        "per_token_logps": [-0.5],
        "loss_mask": [0, 0, 1],
        "request": {"model": "m", "messages": messages},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", **reply}}]},
    }


FIRST_MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "fix the bug"}]
LAST_MESSAGES: list[dict[str, Any]] = [
    *FIRST_MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [tool_call("c1", "bash"), tool_call("c2", "edit")]},
    {"role": "tool", "tool_call_id": "c1", "content": "Traceback (most recent call last): boom"},
    {"role": "tool", "tool_call_id": "c2", "content": "ok"},
    {"role": "assistant", "content": None, "tool_calls": [tool_call("c3", "bash")]},
    # the same failure again, as the agent resent it: counted once
    {"role": "tool", "tool_call_id": "c3", "content": "Traceback (most recent call last): boom"},
    {"role": "tool", "name": "edit", "content": [{"type": "text", "text": "edit FAILED: no match"}]},
]


def agent_trace() -> TrainingTrace:
    return TrainingTrace.model_validate(
        {
            "turns": [
                make_turn("a", FIRST_MESSAGES, {"content": None, "tool_calls": [tool_call("c1", "bash")]}),
                make_turn(
                    "b",
                    FIRST_MESSAGES,
                    {"content": "", "tool_calls": [tool_call("c2", "edit"), tool_call("c3", "bash")]},
                ),
                make_turn("c", LAST_MESSAGES, {"content": "done"}),
            ]
        }
    )


def outcome(**overrides: Any) -> HarnessRolloutOutcome:
    fields: dict[str, Any] = {
        "env_reward": 0.25,
        "completion": [],
        "trace": [],
        "tool_call_count": 0,
        "tool_failure_count": 0,
        "tool_calls_by_name": {},
        "timed_out": False,
    }
    return HarnessRolloutOutcome(**(fields | overrides))


@pytest.mark.slow  # importing TRL pulls in torch and accelerate
def test_outcome_fields_are_trls_in_trls_order() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL warns that experimental APIs may change
        trl_harness = pytest.importorskip("trl.experimental.async_grpo.openenv_harness")

    ours = [field.name for field in dataclasses.fields(HarnessRolloutOutcome)]
    assert ours == [field.name for field in dataclasses.fields(trl_harness.HarnessRolloutOutcome)]


def test_tool_counts_come_from_verify_metrics_when_the_session_reports_them() -> None:
    verify = VerifyResult(
        env_reward=1.0,
        metrics={"tool_calls_by_name": {"bash": 4, "read": 1}, "tool_failure_count": 2, "timed_out": False},
    )

    result = build_outcome(agent_trace(), verify, timed_out=False)

    assert result.tool_calls_by_name == {"bash": 4, "read": 1}
    assert (result.tool_call_count, result.tool_failure_count) == (5, 2)
    assert result.env_reward == 1.0 and result.timed_out is False


def test_tool_counts_are_derived_from_the_trace_without_metrics() -> None:
    result = build_outcome(agent_trace(), SimpleNamespace(env_reward=1), timed_out=False)

    assert result.tool_calls_by_name == {"bash": 2, "edit": 1}
    assert result.tool_call_count == 3
    # bash's traceback (sent twice, counted once) and edit's "FAILED" from a content-part list
    assert result.tool_failure_count == 2
    assert result.env_reward == 1.0 and isinstance(result.env_reward, float)


def test_completion_is_the_last_request_and_its_reply() -> None:
    trace = agent_trace()

    result = build_outcome(trace, VerifyResult(env_reward=None), timed_out=False)

    assert result.completion == [*LAST_MESSAGES, {"role": "assistant", "content": "done"}]
    assert result.trace == trace.to_trace_entries()
    assert result.env_reward is None


def test_empty_trace_has_an_empty_completion_and_no_tools() -> None:
    result = build_outcome(TrainingTrace(turns=[]), VerifyResult(env_reward=0.0), timed_out=False)

    assert (result.completion, result.trace, result.tool_calls_by_name) == ([], [], {})
    assert (result.tool_call_count, result.tool_failure_count) == (0, 0)


@pytest.mark.parametrize(
    ("argument", "reported", "expected"),
    [(False, False, False), (True, False, True), (False, True, True), (True, None, True)],
)
def test_timed_out_is_the_argument_or_the_reported_metric(
    argument: bool, reported: bool | None, expected: bool
) -> None:
    metrics = {} if reported is None else {"timed_out": reported}

    result = build_outcome(agent_trace(), VerifyResult(env_reward=0.0, metrics=metrics), timed_out=argument)

    assert result.timed_out is expected


def test_without_a_reward_fn_the_env_reward_is_the_reward() -> None:
    assert apply_reward_fn(outcome(env_reward=0.25), None) == 0.25
    assert apply_reward_fn(outcome(env_reward=None), None) is None


@pytest.mark.parametrize(
    ("returned", "expected"), [(0.5, 0.5), (1, 1.0), (np.float32(0.5), 0.5), (-2.0, -2.0)]
)
def test_reward_fn_numbers_become_float_rewards(returned: Any, expected: float) -> None:
    reward = apply_reward_fn(outcome(), lambda _: returned)

    assert reward == expected and type(reward) is float


def test_reward_fn_returning_none_leaves_the_rollout_unscored() -> None:
    assert apply_reward_fn(outcome(env_reward=1.0), lambda _: None) is None


def test_reward_fn_sees_the_outcome() -> None:
    def penalise_failures(result: HarnessRolloutOutcome) -> float | None:
        return None if result.env_reward is None else result.env_reward - 0.1 * result.tool_failure_count

    assert apply_reward_fn(outcome(env_reward=1.0, tool_failure_count=2), penalise_failures) == 0.8


@pytest.mark.parametrize("returned", [True, "1.0", [1.0], {"reward": 1.0}])
def test_reward_fn_returning_a_bool_or_non_number_is_an_error(returned: Any) -> None:
    def my_reward(_: HarnessRolloutOutcome) -> Any:
        return returned

    with pytest.raises(RewardFunctionError) as caught:
        apply_reward_fn(outcome(), my_reward)

    assert caught.value.function_name.endswith("my_reward")
    assert "my_reward" in str(caught.value) and repr(returned) in str(caught.value)


@pytest.mark.parametrize("returned", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_reward_fn_returning_a_non_finite_value_is_an_error(returned: float) -> None:
    def my_reward(_: HarnessRolloutOutcome) -> float:
        return returned

    with pytest.raises(RewardFunctionError, match=r"my_reward.*not finite"):
        apply_reward_fn(outcome(), my_reward)


def test_reward_fn_raising_is_a_chained_error_naming_it() -> None:
    def my_reward(_: HarnessRolloutOutcome) -> float:
        raise KeyError("score")

    with pytest.raises(RewardFunctionError, match="my_reward raised KeyError") as caught:
        apply_reward_fn(outcome(), my_reward)

    assert isinstance(caught.value.__cause__, KeyError)


def test_reward_fn_without_a_qualname_is_named_by_its_repr() -> None:
    fn = functools.partial(lambda _, scale: scale, scale=math.nan)

    with pytest.raises(RewardFunctionError) as caught:
        apply_reward_fn(outcome(), fn)

    assert caught.value.function_name == repr(fn)
