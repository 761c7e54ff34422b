"""Trace assembly: call records in, a TrainingTrace dict out (rules in ``capture_proxy.assembly``).

Records are built by hand; every trace is checked against both TrainingTrace models, ours and OpenEnv's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.assembly import (
    UntrainableSession,
    abandoned_retries,
    assemble_trace,
    call_tree,
    duplicate_of,
)
from capture_proxy.records import (
    BUDGET_EXHAUSTED,
    CONTEXT_EXHAUSTED,
    MODEL,
    UPSTREAM_ERROR,
    CallRecord,
    Finding,
)
from harness_trainer.trace import TrainingTrace

try:
    from openenv.core.harness import TrainingTrace as OpenEnvTrainingTrace
except ImportError:  # the `openenv` extra is optional; our own model checks every trace either way
    OpenEnvTrainingTrace = None


def call(
    seq: int,
    prompt: Sequence[int] | None,
    completion: Sequence[int] | None = (),
    *,
    tools: bool = True,
    kind: str = MODEL,
    finding: Finding | None = None,
    logprobs: list[float] | None = None,
) -> CallRecord:
    """A call record named ``c<seq>``; logprobs default to -0.5 per completion id."""
    if logprobs is None and completion is not None:
        logprobs = [-0.5] * len(completion)
    return CallRecord(
        seq=seq,
        call_id=f"c{seq}",
        kind=kind,
        dialect="chat",
        has_tools=tools,
        started_at=100.0 + seq,
        finished_at=100.5 + seq,
        upstream_request={"messages": [{"role": "user", "content": f"call {seq}"}]},
        agent_params={"temperature": 0.2},
        sampling={"temperature": 1.0},
        response={"id": f"chatcmpl-{seq}"},
        prompt_token_ids=list(prompt) if prompt is not None else None,
        completion_token_ids=list(completion) if completion is not None else None,
        logprobs=logprobs,
        weight_version=3,
        finding=finding,
        timings={"upstream_s": 0.25},
    )


def full(record: CallRecord) -> list[int]:
    return (record.prompt_token_ids or []) + (record.completion_token_ids or [])


def assemble(records: Sequence[CallRecord]) -> dict[str, dict[str, Any]]:
    """The trace, checked against both models, as ``{node_id: turn}`` in turn order."""
    trace = assemble_trace(records)
    validate(trace)
    return {turn["node_id"]: turn for turn in trace["turns"]}


def validate(trace: dict[str, Any]) -> None:
    ours = TrainingTrace.model_validate(trace)
    assert TrainingTrace.model_validate_json(json.dumps(trace)) == ours  # plain JSON, unchanged by the trip
    if OpenEnvTrainingTrace is not None:
        OpenEnvTrainingTrace.model_validate(trace)


def supervised(turn: dict[str, Any]) -> bool:
    return any(turn["loss_mask"][len(turn["prompt_token_ids"]) :])


def parents(turns: dict[str, dict[str, Any]]) -> dict[str, str | None]:
    return {node_id: turn["metadata"]["parent"] for node_id, turn in turns.items()}


# A conversation: c0 → c1 → c2, each prompt the previous prompt + completion + a tool result.
CHAIN = [call(0, [1, 2], [3]), call(1, [1, 2, 3, 4], [5, 6]), call(2, [1, 2, 3, 4, 5, 6, 7], [8])]


def test_append_only_conversation_is_one_chain() -> None:
    turns = assemble(CHAIN)
    assert parents(turns) == {"c0": None, "c1": "c0", "c2": "c1"}
    assert [turn["metadata"]["depth"] for turn in turns.values()] == [0, 1, 2]
    assert {turn["metadata"]["root"] for turn in turns.values()} == {"c0"}
    assert turns["c1"]["loss_mask"] == [0, 0, 0, 0, 1, 1]
    assert all(supervised(turn) for turn in turns.values())


def test_turn_carries_the_record_and_its_place_in_the_tree() -> None:
    turn = assemble(CHAIN)["c1"]
    assert turn["per_token_logps"] == [-0.5, -0.5]
    assert turn["request"] == CHAIN[1].upstream_request
    assert turn["response"] == {"id": "chatcmpl-1"}
    assert turn["metadata"] == {
        "seq": 1,
        "parent": "c0",
        "root": "c0",
        "depth": 1,
        "dialect": "chat",
        "has_tools": True,
        "weight_version": 3,
        "dispatch_version": None,
        "sampling": {"temperature": 1.0},
        "agent_params": {"temperature": 0.2},
        "timings": {"upstream_s": 0.25},
        "started_at": 101.0,
        "finished_at": 101.5,
        "auxiliary": False,
        "duplicate_of": None,
        "finding": None,
    }


def test_rewritten_history_starts_a_new_root() -> None:
    compacted = [call(3, [1, 2, 90, 91], [92]), call(4, [1, 2, 90, 91, 92, 93], [94])]
    turns = assemble([*CHAIN, *compacted])
    assert parents(turns) == {"c0": None, "c1": "c0", "c2": "c1", "c3": None, "c4": "c3"}
    assert turns["c4"]["metadata"]["root"] == "c3"
    assert all(supervised(turn) for turn in turns.values())


def test_longest_prefix_wins_over_shorter_ancestor() -> None:
    # c2 extends both c0's and c1's full ids; c1's are the longer prefix. c3 extends only c0's.
    records = [call(0, [1], [2]), call(1, [1, 2, 3], [4]), call(2, [1, 2, 3, 4, 5], [6]), call(3, [1, 2, 7])]
    assert parents(assemble(records)) == {"c0": None, "c1": "c0", "c2": "c1", "c3": "c0"}


def test_identical_full_ids_tie_to_the_lowest_seq() -> None:
    # c1 and c2 end on the same ids by different splits; c3 continues from both: the lowest seq wins.
    records = [
        call(0, [1], [2]),
        call(1, [1, 2, 3], [4]),
        call(2, [1, 2, 3, 4], []),
        call(3, [1, 2, 3, 4, 5]),
    ]
    assert call_tree(records).parent["c3"] == "c1"


def test_same_prompt_is_a_sibling_not_a_parent() -> None:
    # Two empty completions on one prompt would each be a prefix of the other; neither is a parent.
    tree = call_tree([call(0, [1, 2], []), call(1, [1, 2], [])])
    assert tree.parent == {"c0": None, "c1": None}
    assert tree.siblings == [["c0", "c1"]]


def test_abandoned_retry_is_discarded() -> None:
    # The agent retried c0 (say, a client timeout), got c1 and went on from it.
    records = [call(0, [1, 2], [3]), call(1, [1, 2], [4]), call(2, [1, 2, 4, 5], [6])]
    turns = assemble(records)
    assert parents(turns) == {"c1": None, "c2": "c1"}


def test_retry_of_the_final_call_keeps_the_last() -> None:
    records = [*CHAIN, call(3, CHAIN[2].prompt_token_ids, [9, 9]), call(4, CHAIN[2].prompt_token_ids, [7])]
    turns = assemble(records)
    assert list(turns) == ["c0", "c1", "c4"]
    assert turns["c4"]["metadata"]["parent"] == "c1"


def test_identical_duplicate_completion_is_supervised_once() -> None:
    # A retry that sampled the same ids: its child continues from the lowest seq, the other is dropped.
    records = [call(0, [1, 2], [3]), call(1, [1, 2], [3]), call(2, [1, 2, 3, 4], [5])]
    turns = assemble(records)
    assert parents(turns) == {"c0": None, "c2": "c0"}
    assert [node_id for node_id, turn in turns.items() if turn["completion_token_ids"] == [3]] == ["c0"]
    assert supervised(turns["c0"])


def test_twins_that_both_survive_retry_pruning_are_supervised_once() -> None:
    # The guard behind rule 4, on a kept set that rule 3 would never leave.
    tree = call_tree([call(0, [1, 2], [3]), call(1, [1, 2], [3]), call(2, [1, 2], [3])])
    assert tree.twins == [["c0", "c1", "c2"]]
    assert abandoned_retries(tree) == {"c0", "c1"}
    assert duplicate_of(tree, kept={"c0", "c1", "c2"}) == {"c1": "c0", "c2": "c0"}
    assert duplicate_of(tree, kept={"c1", "c2"}) == {"c2": "c1"}


def test_opencode_title_call_is_not_a_training_turn() -> None:
    title = call(5, [50, 51, 1, 2], [52, 53], tools=False)
    turns = assemble([*CHAIN, title])
    assert turns["c5"]["metadata"]["auxiliary"] is True
    assert turns["c5"]["loss_mask"] == [0] * 6
    assert all(supervised(turns[node_id]) for node_id in ("c0", "c1", "c2"))


def test_auxiliary_tree_includes_its_descendants() -> None:
    records = [*CHAIN, call(5, [50], [51], tools=False), call(6, [50, 51, 52], [53], tools=False)]
    turns = assemble(records)
    assert [turns[node_id]["metadata"]["auxiliary"] for node_id in ("c5", "c6")] == [True, True]
    assert not supervised(turns["c6"])


def test_toolless_call_inside_a_tool_conversation_is_trained() -> None:
    # e.g. a final answer requested without tools: its tree carries tools, so it is no side path.
    records = [*CHAIN, call(3, [*full(CHAIN[2]), 9], [10], tools=False)]
    turns = assemble(records)
    assert turns["c3"]["metadata"]["auxiliary"] is False
    assert supervised(turns["c3"])


def test_toolless_session_has_no_auxiliary_calls() -> None:
    # mini-swe-agent: text actions, no tools anywhere; a separate root is still trained.
    records = [call(0, [1, 2], [3], tools=False), call(1, [1, 2, 3, 4], [5], tools=False)]
    turns = assemble([*records, call(2, [60, 61], [62], tools=False)])
    assert not any(turn["metadata"]["auxiliary"] for turn in turns.values())
    assert all(supervised(turn) for turn in turns.values())


def test_finding_demotes_a_call_to_context() -> None:
    finding = Finding("bad_logprobs", "logprobs must be finite and <= 0")
    records = [CHAIN[0], call(1, [1, 2, 3, 4], [5, 6], finding=finding), CHAIN[2]]
    turns = assemble(records)
    assert turns["c1"]["loss_mask"] == [0] * 6
    assert turns["c1"]["metadata"]["finding"] == finding.to_json()
    assert parents(turns) == {"c0": None, "c1": "c0", "c2": "c1"}
    assert supervised(turns["c2"])


@pytest.mark.parametrize("logprobs", [None, [-0.5], [float("nan"), -0.5], [0.5, -0.5]])
def test_finding_with_unusable_logprobs_gets_placeholders(logprobs: list[float] | None) -> None:
    finding = Finding("no_logprobs", "the engine returned no logprobs.content for the sampled ids")
    record = call(0, [1, 2], [3, 4], finding=finding)
    record.logprobs = logprobs
    turn = assemble([record])["c0"]
    assert turn["per_token_logps"] == [0.0, 0.0]
    assert turn["metadata"]["placeholder_logprobs"] is True
    assert not supervised(turn)


def test_empty_completion_is_kept() -> None:
    records = [call(0, [1, 2], [3]), call(1, [1, 2, 3, 4], [])]
    turns = assemble(records)
    assert turns["c1"]["completion_token_ids"] == []
    assert turns["c1"]["loss_mask"] == [0, 0, 0, 0]
    assert turns["c1"]["per_token_logps"] == []


def test_session_without_ids_is_untrainable() -> None:
    with pytest.raises(UntrainableSession) as raised:
        assemble_trace([call(0, None, None), call(1, None, None)])
    assert "returned no token ids" in raised.value.reason
    assert "--return-tokens-as-token-ids" in raised.value.reason


def test_session_with_only_invalid_ids_is_untrainable() -> None:
    finding = Finding("empty_prompt", "the engine returned an empty prompt_token_ids")
    with pytest.raises(UntrainableSession, match="invalid ones"):
        assemble_trace([call(0, [], [1], finding=finding), call(1, [1, -2], [3])])


def test_session_without_model_calls_is_untrainable() -> None:
    with pytest.raises(UntrainableSession, match="no model calls"):
        assemble_trace([call(0, None, None, kind=BUDGET_EXHAUSTED)])
    with pytest.raises(UntrainableSession, match="no model calls"):
        assemble_trace([])


def test_calls_without_ids_among_captured_calls_are_left_out() -> None:
    turns = assemble([*CHAIN, call(3, None, None)])
    assert list(turns) == ["c0", "c1", "c2"]


def test_budget_and_error_records_are_not_turns() -> None:
    others = [
        call(3, full(CHAIN[2]), [1], kind=BUDGET_EXHAUSTED),
        call(4, full(CHAIN[2]), [1], kind=CONTEXT_EXHAUSTED),
        call(5, full(CHAIN[2]), None, kind=UPSTREAM_ERROR),
    ]
    turns = assemble([*CHAIN, *others])
    assert list(turns) == ["c0", "c1", "c2"]


def test_output_validates_as_training_trace() -> None:
    title = call(5, [50], [51], tools=False)
    trace = assemble_trace([*CHAIN, title, call(6, full(CHAIN[0]), [], finding=Finding("x", "y"))])
    assert set(trace) == {"schema_version", "turns"} and trace["schema_version"] == 1
    openenv_harness = pytest.importorskip("openenv.core.harness")
    ours = TrainingTrace.model_validate(trace)
    theirs = openenv_harness.TrainingTrace.model_validate(trace)
    assert json.loads(ours.model_dump_json()) == json.loads(theirs.model_dump_json())
    assert TrainingTrace.model_validate_json(json.dumps(trace)) == ours


def test_hundreds_of_long_calls_assemble_in_linear_time() -> None:
    # 300 appended calls growing to ~30k ids, a retry every 10 calls and a title call: no timing assert,
    # but a quadratic search would show here (assembly takes ~0.1 s of 5M ids on a laptop-class CPU).
    rng = random.Random(7)
    records: list[CallRecord] = [call(0, [50, 51], [52], tools=False)]
    prompt = [rng.randrange(50_000) for _ in range(200)]
    for step in range(300):
        completion = [rng.randrange(50_000) for _ in range(20)]
        if step % 10 == 5:
            records.append(call(len(records), prompt, [1, 2, 3]))
        records.append(call(len(records), prompt, completion))
        prompt = prompt + completion + [rng.randrange(50_000) for _ in range(80)]
    turns = assemble_trace(records)["turns"]  # not validated here: pydantic on 5M ids dominates the test
    assert len(turns) == 301
    chain = [turn for turn in turns if not turn["metadata"]["auxiliary"]]
    assert [turn["metadata"]["depth"] for turn in chain] == list(range(300))
    assert len(chain[-1]["prompt_token_ids"]) > 29_000


# --- properties over random call forests -----------------------------------------------------------

TOKENS = st.integers(min_value=0, max_value=3)  # a tiny vocabulary makes chance prefixes common


@st.composite
def sessions(draw: st.DrawFn) -> list[CallRecord]:
    """A session grown call by call: a new root, a continuation of an earlier call, or a retry of one."""
    records: list[CallRecord] = []
    for seq in range(draw(st.integers(min_value=1, max_value=14))):
        model = [record for record in records if record.kind == MODEL and record.has_ids]
        move = draw(st.sampled_from(["root", "continue", "continue", "retry", "other"])) if model else "root"
        base = draw(st.sampled_from(model)) if model else None
        if move == "root" or base is None:
            prompt = draw(st.lists(TOKENS, min_size=1, max_size=4))
        elif move == "continue":
            prompt = full(base) + draw(st.lists(TOKENS, max_size=3))
        else:
            prompt = list(base.prompt_token_ids or [])
        completion = draw(st.lists(TOKENS, max_size=3))
        finding = Finding("bad_logprobs", "drawn") if draw(st.integers(0, 9)) == 0 else None
        kind = draw(st.sampled_from([BUDGET_EXHAUSTED, UPSTREAM_ERROR])) if move == "other" else MODEL
        records.append(call(seq, prompt, completion, tools=draw(st.booleans()), kind=kind, finding=finding))
    return records


def naive_parents(candidates: list[CallRecord]) -> dict[str, str | None]:
    """Rule 2 by brute force: the longest full-ids prefix, lowest seq on ties, same prompt excluded."""
    result: dict[str, str | None] = {}
    for record in candidates:
        prompt = record.prompt_token_ids or []
        best: CallRecord | None = None
        for other in sorted(candidates, key=lambda other: other.seq):
            ids = full(other)
            shorter = len(other.prompt_token_ids or []) < len(prompt)
            if shorter and prompt[: len(ids)] == ids and (best is None or len(ids) > len(full(best))):
                best = other
        result[record.call_id] = best.call_id if best is not None else None
    return result


@settings(max_examples=300, deadline=None)
@given(sessions())
def test_random_forests_assemble_into_valid_supervised_once_traces(records: list[CallRecord]) -> None:
    candidates = [record for record in records if record.kind == MODEL]
    tree = call_tree(records)
    assert tree.parent == naive_parents(candidates)
    turns = assemble(records)
    by_id = {record.call_id: record for record in candidates}
    assert [turn["metadata"]["seq"] for turn in turns.values()] == sorted(by_id[n].seq for n in turns)
    for record in candidates:  # every candidate is a turn or an abandoned retry of a sibling that is
        if record.call_id not in turns:
            assert not tree.children[record.call_id]
            assert any(turn["prompt_token_ids"] == record.prompt_token_ids for turn in turns.values())
    pairs = [
        (tuple(turn["prompt_token_ids"]), tuple(turn["completion_token_ids"]))
        for turn in turns.values()
        if supervised(turn)
    ]
    assert len(pairs) == len(set(pairs))
    for turn in turns.values():
        parent = turn["metadata"]["parent"]
        if parent is not None:
            ids = full(by_id[parent])
            assert parent in turns and turn["prompt_token_ids"][: len(ids)] == ids
        assert_auxiliary_rule(turn, candidates, tree.root)


def assert_auxiliary_rule(turn: dict[str, Any], candidates: list[CallRecord], root: dict[str, str]) -> None:
    session_tools = any(record.has_tools for record in candidates)
    tree_tools = any(r.has_tools for r in candidates if root[r.call_id] == turn["metadata"]["root"])
    assert turn["metadata"]["auxiliary"] is (session_tools and not tree_tools)
    if turn["metadata"]["auxiliary"] or turn["metadata"]["finding"] or turn["metadata"]["duplicate_of"]:
        assert not supervised(turn)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_parent_is_independent_of_arrival_order(data: st.DataObject) -> None:
    records = data.draw(sessions())
    shuffled = data.draw(st.permutations(records))
    assert assemble_trace(shuffled) == assemble_trace(records)
    assert call_tree(shuffled) == call_tree(records)
