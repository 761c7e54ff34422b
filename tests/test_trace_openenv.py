"""Wire compatibility with OpenEnv's TrainingTrace, both directions, and the same rejections.

Skipped when the `openenv` extra is absent; CI installs it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

openenv_harness = pytest.importorskip("openenv.core.harness")

from pydantic import ValidationError  # noqa: E402

from harness_trainer.trace import CaptureContractError, TrainingTrace, dump_trace, load_trace  # noqa: E402


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


def without(turn: dict[str, Any], field: str) -> dict[str, Any]:
    return {key: value for key, value in turn.items() if key != field}


VARIED_TRACE = make_trace(
    make_turn(node_id="root", request={"messages": [{"role": "user", "content": "fix it"}]}),
    make_turn(node_id="partial", loss_mask=[0, 0, 0, 0, 1], response={"id": "c-1"}),
    make_turn(node_id="context", per_token_logps=[-0.0, -3.0e-9], loss_mask=[0, 0, 0, 0, 0]),
    make_turn(node_id="prompt-only", completion_token_ids=[], per_token_logps=[], loss_mask=[0, 0, 0]),
    make_turn(node_id="aux", metadata={"aux": True, "parent": "root"}),
)


def test_our_json_validates_under_openenv_and_dumps_back_identically() -> None:
    ours = dump_trace(load_trace(VARIED_TRACE))
    theirs = openenv_harness.TrainingTrace.model_validate_json(ours)
    assert theirs.model_dump_json() == ours


def test_to_openenv_returns_openenv_model_with_the_same_content() -> None:
    theirs = load_trace(VARIED_TRACE).to_openenv()
    assert isinstance(theirs, openenv_harness.TrainingTrace)
    assert theirs.model_dump() == load_trace(VARIED_TRACE).model_dump()


def test_trace_built_with_openenv_classes_loads_here() -> None:
    theirs = openenv_harness.TrainingTrace(
        turns=[openenv_harness.TrainingTurn(**turn) for turn in VARIED_TRACE["turns"]]
    )
    from_json = load_trace(theirs.model_dump_json(), session_id="sess-1")
    assert from_json.model_dump() == theirs.model_dump()
    assert TrainingTrace.from_openenv(theirs) == from_json


def test_trace_built_with_openenv_from_entries_loads_here() -> None:
    entries = [
        {**without(turn, "node_id"), "metadata": {**turn.get("metadata", {}), "node_id": turn["node_id"]}}
        for turn in VARIED_TRACE["turns"]
    ]
    theirs = openenv_harness.TrainingTrace.from_entries(entries)
    ours = TrainingTrace.from_openenv(theirs)
    assert [turn.node_id for turn in ours.turns] == ["root", "partial", "context", "prompt-only", "aux"]
    assert ours.turns[1].loss_mask == [0, 0, 0, 0, 1]
    assert ours.turns[0].metadata["node_id"] == "root"
    assert load_trace(theirs.model_dump_json()) == ours


def test_from_openenv_revalidates_and_raises_capture_contract_error() -> None:
    unchecked = openenv_harness.TrainingTrace.model_construct(
        schema_version=1,
        turns=[openenv_harness.TrainingTurn.model_construct(**make_turn(loss_mask=[1, 0, 0, 1, 1]))],
    )
    with pytest.raises(CaptureContractError) as caught:
        TrainingTrace.from_openenv(unchecked)
    assert caught.value.rules == ["trainable_prompt"]


# Inputs both implementations accept; each must also dump to the same JSON on both sides.
LEGAL = {
    "prompt-only turn": make_trace(make_turn(completion_token_ids=[], per_token_logps=[], loss_mask=[0] * 3)),
    "zero and negative zero logprobs": make_trace(make_turn(per_token_logps=[0.0, -0.0])),
    "integer logprobs": make_trace(make_turn(per_token_logps=[-1, 0])),
    "all-zero mask": make_trace(make_turn(loss_mask=[0, 0, 0, 0, 0])),
    "no turns": make_trace(turns=[]),
    "no schema_version": {"turns": [make_turn()]},
    "huge token id": make_trace(make_turn(prompt_token_ids=[2**63, 0, 1])),
}


@pytest.mark.parametrize("trace", LEGAL.values(), ids=LEGAL.keys())
def test_both_implementations_accept_the_same_edge_cases(trace: dict[str, Any]) -> None:
    text = json.dumps(trace)
    theirs = openenv_harness.TrainingTrace.model_validate_json(text)
    assert dump_trace(load_trace(text)) == theirs.model_dump_json()
    assert load_trace(trace).model_dump() == openenv_harness.TrainingTrace.model_validate(trace).model_dump()


# rule code -> an input breaking it; OpenEnv reports most of these as a generic value_error.
REJECTED = [
    ("invalid_token_id", make_trace(make_turn(prompt_token_ids=[-1, 12, 13]))),
    ("invalid_token_id", make_trace(make_turn(completion_token_ids=[True, 22]))),
    ("invalid_token_id", make_trace(make_turn(prompt_token_ids=[11.0, 12, 13]))),
    ("invalid_logprob", make_trace(make_turn(per_token_logps=[-0.25, math.nan]))),
    ("invalid_logprob", make_trace(make_turn(per_token_logps=[-math.inf, -1.5]))),
    ("invalid_logprob", make_trace(make_turn(per_token_logps=[False, -1.5]))),
    ("positive_logprob", make_trace(make_turn(per_token_logps=[-0.25, 0.1]))),
    ("logprob_misalign", make_trace(make_turn(per_token_logps=[-0.25]))),
    ("logprob_misalign", make_trace(make_turn(per_token_logps=[-0.25, -1.5, -2.0]))),
    ("no_prompt_ids", make_trace(make_turn(prompt_token_ids=[], loss_mask=[1, 1]))),
    ("length_mismatch", make_trace(make_turn(loss_mask=[0, 0, 1, 1]))),
    ("invalid_loss_mask", make_trace(make_turn(loss_mask=[0, 0, 0, 2, 1]))),
    ("invalid_loss_mask", make_trace(make_turn(loss_mask=[0, 0, 0, True, 1]))),
    ("trainable_prompt", make_trace(make_turn(loss_mask=[0, 1, 0, 1, 1]))),
    ("duplicate_node_id", make_trace(make_turn(node_id="a"), make_turn(node_id="a"))),
    ("extra_forbidden", make_trace(make_turn(reward=1.0))),
    ("extra_forbidden", make_trace(reward=1.0)),
    ("literal_error", make_trace(schema_version=2)),
    ("string_too_short", make_trace(make_turn(node_id=""))),
    ("missing", make_trace(without(make_turn(), "loss_mask"))),
]


@pytest.mark.parametrize(
    ("rule", "trace"), REJECTED, ids=[f"{i}-{rule}" for i, (rule, _) in enumerate(REJECTED)]
)
def test_both_implementations_reject_the_same_bad_input(rule: str, trace: dict[str, Any]) -> None:
    text = json.dumps(trace)
    with pytest.raises(ValidationError):
        openenv_harness.TrainingTrace.model_validate(trace)
    with pytest.raises(ValidationError):
        openenv_harness.TrainingTrace.model_validate_json(text)
    for data in (trace, text):
        with pytest.raises(CaptureContractError) as caught:
            load_trace(data)
        assert rule in caught.value.rules


def test_both_implementations_reject_malformed_json() -> None:
    text = json.dumps(make_trace())[:-2]
    with pytest.raises(ValidationError):
        openenv_harness.TrainingTrace.model_validate_json(text)
    with pytest.raises(CaptureContractError) as caught:
        load_trace(text)
    assert caught.value.rules == ["invalid_json"]
