"""TrainingTrace contract: every rule rejects with its code; legal edge cases load and round-trip."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from harness_trainer.trace import CaptureContractError, TrainingTrace, TrainingTurn, dump_trace, load_trace


def make_turn(**overrides: Any) -> dict[str, Any]:
    turn: dict[str, Any] = {
        "node_id": "n0",
        "prompt_token_ids": [11, 12, 13],
        "completion_token_ids": [21, 22],
        "per_token_logps": [-0.25, -1.5],
        "loss_mask": [0, 0, 0, 1, 1],
    }
    return turn | overrides


def make_trace(*turns: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return {"schema_version": 1, "turns": list(turns) or [make_turn()]} | overrides


def assert_breaks(rule: str, trace: dict[str, Any]) -> CaptureContractError:
    """The rule is broken by direct construction, by load_trace on a dict, and on JSON text."""
    with pytest.raises(ValidationError) as direct:
        TrainingTrace(**trace)
    assert rule in {error["type"] for error in direct.value.errors()}
    with pytest.raises(CaptureContractError) as from_json:
        load_trace(json.dumps(trace), session_id="sess-1")
    assert rule in from_json.value.rules
    with pytest.raises(CaptureContractError) as from_dict:
        load_trace(trace, session_id="sess-1")
    assert rule in from_dict.value.rules
    assert isinstance(from_dict.value.__cause__, ValidationError)
    return from_dict.value


def test_valid_trace_builds() -> None:
    trace = load_trace(make_trace(make_turn(), make_turn(node_id="n1", metadata={"k": 1})))
    assert [turn.node_id for turn in trace.turns] == ["n0", "n1"]
    assert trace.schema_version == 1
    assert trace.turns[1].metadata == {"k": 1} and trace.turns[0].request == {}


def test_turn_built_directly_with_a_broken_rule_raises_validation_error() -> None:
    with pytest.raises(ValidationError) as caught:
        TrainingTurn(**make_turn(loss_mask=[1, 0, 0, 1, 1]))
    assert [error["type"] for error in caught.value.errors()] == ["trainable_prompt"]


@pytest.mark.parametrize("field", ["prompt_token_ids", "completion_token_ids"])
@pytest.mark.parametrize("bad_id", [-1, True, False, 1.0, "7"])
def test_negative_bool_or_non_int_token_id_is_rejected_as_invalid_token_id(field: str, bad_id: Any) -> None:
    turn = make_turn()
    turn[field] = [bad_id, *turn[field][1:]]
    assert_breaks("invalid_token_id", make_trace(turn))


@pytest.mark.parametrize("bad_logprob", [math.nan, math.inf, -math.inf, True, False, "-0.5", None])
def test_non_finite_bool_or_non_number_logprob_is_rejected_as_invalid_logprob(bad_logprob: Any) -> None:
    assert_breaks("invalid_logprob", make_trace(make_turn(per_token_logps=[-0.25, bad_logprob])))


@pytest.mark.parametrize("bad_logprob", [1e-12, 0.5, 3])
def test_positive_logprob_is_rejected_as_positive_logprob(bad_logprob: float) -> None:
    assert_breaks("positive_logprob", make_trace(make_turn(per_token_logps=[-0.25, bad_logprob])))


@pytest.mark.parametrize("logps", [[-0.25], [-0.25, -1.0, -2.0], []])
def test_logprob_count_other_than_completion_length_is_rejected_as_logprob_misalign(
    logps: list[float],
) -> None:
    assert_breaks("logprob_misalign", make_trace(make_turn(per_token_logps=logps)))


def test_empty_prompt_is_rejected_as_no_prompt_ids() -> None:
    assert_breaks("no_prompt_ids", make_trace(make_turn(prompt_token_ids=[], loss_mask=[1, 1])))


@pytest.mark.parametrize("mask", [[0, 0, 1, 1], [0, 0, 0, 1, 1, 1], []])
def test_mask_not_covering_prompt_plus_completion_is_rejected_as_length_mismatch(mask: list[int]) -> None:
    assert_breaks("length_mismatch", make_trace(make_turn(loss_mask=mask)))


@pytest.mark.parametrize("bad_bit", [2, -1, True, 1.0, "1"])
def test_mask_value_other_than_int_zero_or_one_is_rejected_as_invalid_loss_mask(bad_bit: Any) -> None:
    assert_breaks("invalid_loss_mask", make_trace(make_turn(loss_mask=[0, 0, 0, 1, bad_bit])))


def test_prompt_position_in_mask_is_rejected_as_trainable_prompt() -> None:
    assert_breaks("trainable_prompt", make_trace(make_turn(loss_mask=[0, 1, 0, 1, 1])))


def test_repeated_node_id_is_rejected_as_duplicate_node_id_naming_the_node() -> None:
    error = assert_breaks("duplicate_node_id", make_trace(make_turn(node_id="a"), make_turn(node_id="a")))
    assert error.node_id == "a"
    assert "'a'" in str(error)


@pytest.mark.parametrize(
    "trace",
    [make_trace(make_turn(reward=1.0)), make_trace(reward=1.0)],
    ids=["unknown turn field", "unknown trace field"],
)
def test_unknown_field_is_rejected_as_extra_forbidden(trace: dict[str, Any]) -> None:
    assert_breaks("extra_forbidden", trace)


def test_wrong_schema_version_is_rejected_as_literal_error() -> None:
    assert_breaks("literal_error", make_trace(schema_version=2))


def test_empty_node_id_is_rejected_as_string_too_short() -> None:
    assert_breaks("string_too_short", make_trace(make_turn(node_id="")))


def test_missing_loss_mask_is_rejected_as_missing() -> None:
    turn = make_turn()
    del turn["loss_mask"]
    assert_breaks("missing", make_trace(turn))


@pytest.mark.parametrize("text", ['{"schema_version": 1, "turns": [', "", b"\xff"])
def test_malformed_json_text_is_rejected_as_invalid_json(text: str | bytes) -> None:
    with pytest.raises(CaptureContractError) as caught:
        load_trace(text, session_id="sess-9")
    assert caught.value.rules == ["invalid_json"]
    assert caught.value.node_id is None and "sess-9" in str(caught.value)


def test_error_names_the_session_and_the_offending_node() -> None:
    trace = make_trace(make_turn(node_id="ok"), make_turn(node_id="bad", loss_mask=[1, 0, 0, 1, 1]))
    with pytest.raises(CaptureContractError) as caught:
        load_trace(json.dumps(trace), session_id="sess-42")
    error = caught.value
    assert isinstance(error, ValueError)
    assert (error.session_id, error.node_id, error.rules) == ("sess-42", "bad", ["trainable_prompt"])
    assert all(part in str(error) for part in ("sess-42", "turn 1 (node 'bad')", "trainable_prompt"))


def test_error_lists_each_rule_broken_once_and_names_the_first_offending_node() -> None:
    trace = make_trace(
        make_turn(node_id="a", prompt_token_ids=[-1, -2, -3]),
        make_turn(node_id="b", per_token_logps=[0.5, 0.5], loss_mask=[0, 0, 0, 2, 1]),
    )
    error = assert_breaks("invalid_token_id", trace)
    assert error.rules == ["invalid_token_id", "positive_logprob", "invalid_loss_mask"]
    assert error.node_id == "a"
    assert str(error).count("invalid_token_id") == 1


def test_a_long_list_of_problems_is_cut_short_in_the_message() -> None:
    turns = [make_turn(node_id=f"n{i}", loss_mask=[1, 0, 0, 1, 1]) for i in range(13)]
    with pytest.raises(CaptureContractError) as caught:
        load_trace(make_trace(*turns))
    assert str(caught.value).endswith("; and 3 more")
    assert "an unnamed session" in str(caught.value)


def test_input_that_is_not_an_object_is_rejected_without_a_node() -> None:
    with pytest.raises(CaptureContractError) as caught:
        load_trace("[1, 2]")
    assert (caught.value.rules, caught.value.node_id) == (["model_type"], None)


@pytest.mark.parametrize("zero", [0.0, -0.0, 0])
def test_zero_logprob_in_any_spelling_is_accepted(zero: float) -> None:
    trace = load_trace(make_trace(make_turn(per_token_logps=[zero, -1.0])))
    assert trace.turns[0].per_token_logps == [0.0, -1.0]


def test_integer_logprob_is_accepted_and_stored_as_a_float() -> None:
    trace = load_trace(json.dumps({"turns": [make_turn(per_token_logps=[-2, -1])]}))
    assert [type(lp) for lp in trace.turns[0].per_token_logps] == [float, float]


def test_prompt_only_turn_with_empty_completion_is_accepted() -> None:
    turn = make_turn(completion_token_ids=[], per_token_logps=[], loss_mask=[0, 0, 0])
    assert load_trace(make_trace(turn)).turns[0].completion_token_ids == []


def test_trace_without_turns_or_schema_version_is_accepted() -> None:
    assert load_trace({"turns": []}) == TrainingTrace(schema_version=1, turns=[])


@pytest.mark.parametrize("completion_mask", [[1, 0, 1, 0], [0, 0, 0, 0]], ids=["partial", "all zero"])
def test_mask_survives_a_json_round_trip(completion_mask: list[int]) -> None:
    turn = make_turn(
        completion_token_ids=[21, 22, 23, 24],
        per_token_logps=[-0.1, -2.5e-08, -0.0, -13.75],
        loss_mask=[0, 0, 0, *completion_mask],
    )
    restored = load_trace(dump_trace(load_trace(make_trace(turn))))
    assert restored.turns[0].loss_mask == [0, 0, 0, *completion_mask]
    assert [repr(lp) for lp in restored.turns[0].per_token_logps] == ["-0.1", "-2.5e-08", "-0.0", "-13.75"]


def test_request_response_and_metadata_survive_a_json_round_trip() -> None:
    dicts = {
        "request": {"messages": [{"role": "user", "content": "hi ✓"}], "temperature": 0.7},
        "response": {"choices": [{"finish_reason": "stop"}], "usage": {"prompt_tokens": 3}},
        "metadata": {"parent": None, "aux": False, "tags": ["a", "b"]},
    }
    restored = load_trace(dump_trace(load_trace(make_trace(make_turn(**dicts)))))
    assert restored.turns[0].model_dump(include=set(dicts)) == dicts


def test_to_openenv_without_the_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openenv.core.harness", None)
    with pytest.raises(ImportError, match=r"`openenv` extra"):
        load_trace(make_trace()).to_openenv()


_JSON_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
)
_JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3),
    max_leaves=8,
)
_TOKEN_IDS = st.integers(min_value=0, max_value=2**40)


@st.composite
def valid_turns(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(st.lists(_TOKEN_IDS, min_size=1, max_size=12))
    completion = draw(st.lists(_TOKEN_IDS, max_size=12))
    size = len(completion)
    logps = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
    return {
        "node_id": draw(st.text(min_size=1, max_size=8)),
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "per_token_logps": draw(st.lists(logps, min_size=size, max_size=size)),
        "loss_mask": [0] * len(prompt) + draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)),
        "request": draw(st.dictionaries(st.text(max_size=5), _JSON_VALUES, max_size=3)),
        "response": draw(st.dictionaries(st.text(max_size=5), _JSON_VALUES, max_size=3)),
        "metadata": draw(st.dictionaries(st.text(max_size=5), _JSON_VALUES, max_size=3)),
    }


@given(st.lists(valid_turns(), max_size=4, unique_by=lambda turn: turn["node_id"]))
def test_valid_turns_round_trip_through_json_unchanged(turns: list[dict[str, Any]]) -> None:
    text = dump_trace(load_trace({"schema_version": 1, "turns": turns}))
    restored = load_trace(text)
    assert restored.model_dump() == {"schema_version": 1, "turns": turns}
    for before, after in zip(turns, restored.turns, strict=True):
        exact = [repr(float(lp)) for lp in before["per_token_logps"]]
        assert [repr(lp) for lp in after.per_token_logps] == exact
    assert dump_trace(restored) == text
