"""Rows from a TrainingTrace: one per leaf of the prefix forest, every sampled token trained exactly once."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness_trainer.trace import CaptureContractError, TrainingTrace
from harness_trainer.trainer.step.rows import Row, build_rows, row_stats


def make_turn(
    node_id: str,
    prompt: list[int],
    completion: list[int],
    mask: list[int] | None = None,
    logps: list[float] | None = None,
) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "per_token_logps": logps if logps is not None else [-(k + 1) / 8 for k in range(len(completion))],
        "loss_mask": [0] * len(prompt) + (mask if mask is not None else [1] * len(completion)),
    }


def make_trace(*turns: dict[str, Any]) -> TrainingTrace:
    return TrainingTrace.model_validate({"schema_version": 1, "turns": list(turns)})


def full(turn: dict[str, Any]) -> list[int]:
    return turn["prompt_token_ids"] + turn["completion_token_ids"]


def target_positions(row: Row) -> list[int]:
    return [position for position, target in enumerate(row.targets) if target]


def append_only_chain(turns: int, new_tokens: int = 3, completion_tokens: int = 4) -> list[dict[str, Any]]:
    """Each turn's prompt is the previous prompt and completion plus a few new tokens (tool output)."""
    chain: list[dict[str, Any]] = []
    history: list[int] = [1, 2, 3]
    for index in range(turns):
        prompt = history + [1000 + index * 10 + k for k in range(new_tokens)]
        completion = [5000 + index * 10 + k for k in range(completion_tokens)]
        chain.append(make_turn(f"t{index}", prompt, completion))
        history = prompt + completion
    return chain


def test_append_only_chain_is_one_row_training_every_completion() -> None:
    chain = append_only_chain(50)
    trace = make_trace(*chain)

    rows = build_rows(trace)

    assert len(rows) == 1
    (row,) = rows
    assert row.input_ids == full(chain[-1])
    expected = [
        position for turn in chain for position in range(len(turn["prompt_token_ids"]), len(full(turn)))
    ]
    assert target_positions(row) == expected
    assert [row.input_ids[p] for p in expected] == [t for turn in chain for t in turn["completion_token_ids"]]
    stats = row_stats(trace, rows)
    assert stats.rows == 1 and stats.roots == 1
    assert stats.unique_tokens == len(full(chain[-1]))
    assert stats.forwarded_tokens / stats.unique_tokens == 1.0
    assert stats.trained_tokens == 50 * 4


def test_fork_gives_a_row_per_branch_and_trains_the_shared_turn_once() -> None:
    root = make_turn("root", [1, 2], [3, 4])
    left = make_turn("left", [1, 2, 3, 4, 10], [11, 12])
    right = make_turn("right", [1, 2, 3, 4, 20, 21], [22])
    trace = make_trace(root, left, right)

    rows = build_rows(trace)

    assert [row.input_ids for row in rows] == [full(left), full(right)]
    assert target_positions(rows[0]) == [2, 3, 5, 6]  # the shared root's completion, then left's own
    assert target_positions(rows[1]) == [6]  # the root's completion is context here
    stats = row_stats(trace, rows)
    assert (stats.rows, stats.roots, stats.trained_tokens) == (2, 1, 5)
    assert stats.forwarded_tokens == 7 + 7
    assert stats.unique_tokens == 4 + 3 + 3


def test_rewritten_history_starts_a_new_tree_and_row() -> None:
    first = make_turn("first", [1, 2, 3], [4, 5])
    second = make_turn("second", [1, 2, 3, 4, 5, 6], [7])
    compacted = make_turn("compacted", [1, 2, 99], [8, 9])  # same system prompt, summarised history
    after = make_turn("after", [1, 2, 99, 8, 9, 6], [10])
    trace = make_trace(first, second, compacted, after)

    rows = build_rows(trace)

    assert [row.input_ids for row in rows] == [full(second), full(after)]
    assert target_positions(rows[0]) == [3, 4, 6]
    assert target_positions(rows[1]) == [3, 4, 6]
    stats = row_stats(trace, rows)
    assert stats.roots == 2
    assert stats.unique_tokens == 7 + 5  # the shared [1, 2] counted once


def test_partial_completion_mask_trains_only_its_masked_positions() -> None:
    turn = make_turn("n0", [1, 2], [3, 4, 5, 6], mask=[1, 0, 0, 1], logps=[-0.1, -0.2, -0.3, -0.4])

    (row,) = build_rows(make_trace(turn))

    assert row.targets == [0, 0, 1, 0, 0, 1]
    assert row.behaviour_logps == [0.0, 0.0, -0.1, 0.0, 0.0, -0.4]
    assert row.n_targets == 2


def test_behaviour_logps_sit_at_the_target_positions() -> None:
    first = make_turn("n0", [7], [8, 9], logps=[-0.5, -0.25])
    second = make_turn("n1", [7, 8, 9, 3], [4, 5, 6], logps=[-1.0, -2.0, -3.0])

    (row,) = build_rows(make_trace(first, second))

    assert row.input_ids == [7, 8, 9, 3, 4, 5, 6]
    assert row.targets == [0, 1, 1, 0, 1, 1, 1]
    assert row.behaviour_logps == [0.0, -0.5, -0.25, 0.0, -1.0, -2.0, -3.0]


def test_zero_masked_auxiliary_leaf_is_not_a_row() -> None:
    title = make_turn("title", [50, 51], [52, 53], mask=[0, 0])
    agent = make_turn("agent", [1, 2], [3])
    trace = make_trace(title, agent)

    rows = build_rows(trace)

    assert [row.input_ids for row in rows] == [[1, 2, 3]]
    stats = row_stats(trace, rows)
    assert (stats.rows, stats.roots, stats.trained_tokens) == (1, 2, 1)


def test_parent_may_come_after_its_child_in_the_trace() -> None:
    chain = append_only_chain(5)

    forward, backward = build_rows(make_trace(*chain)), build_rows(make_trace(*reversed(chain)))

    assert len(backward) == 1
    assert backward[0] == forward[0]


def test_identical_turns_give_their_children_to_the_earliest_and_each_is_trained() -> None:
    first = make_turn("first", [1, 2], [3], logps=[-0.1])
    retry = make_turn("retry", [1, 2], [3], logps=[-0.2])
    child = make_turn("child", [1, 2, 3, 4], [5], logps=[-0.3])

    rows = build_rows(make_trace(first, retry, child))

    # Leaves in call order: the retry (its own sample, trained once) and the child, whose path is `first`.
    assert [row.input_ids for row in rows] == [[1, 2, 3], [1, 2, 3, 4, 5]]
    assert rows[0].behaviour_logps == [0.0, 0.0, -0.2]
    assert rows[1].behaviour_logps == [0.0, 0.0, -0.1, 0.0, -0.3]


def test_turn_with_the_same_prompt_is_a_sibling_not_a_parent() -> None:
    prompt_only = make_turn("prompt_only", [1, 2], [])
    also_prompt_only = make_turn("also_prompt_only", [1, 2], [])
    sampled = make_turn("sampled", [1, 2], [3])

    trace = make_trace(prompt_only, also_prompt_only, sampled)
    rows = build_rows(trace)

    assert [row.input_ids for row in rows] == [[1, 2, 3]]
    assert row_stats(trace, rows).roots == 3


def test_prompt_only_turn_continues_its_parent_path() -> None:
    first = make_turn("first", [1], [2])
    prompt_only = make_turn("prompt_only", [1, 2, 3], [])
    last = make_turn("last", [1, 2, 3, 4], [5])

    (row,) = build_rows(make_trace(first, prompt_only, last))

    assert row.input_ids == [1, 2, 3, 4, 5] and target_positions(row) == [1, 4]


def test_rows_carry_the_rollout_index() -> None:
    rows = build_rows(make_trace(make_turn("n0", [1], [2])), rollout=7)

    assert [row.rollout for row in rows] == [7]


def test_empty_trace_has_no_rows() -> None:
    trace = make_trace()

    assert build_rows(trace) == []
    assert row_stats(trace, []).unique_tokens == 0


@pytest.mark.parametrize("where", ["prompt", "completion"])
def test_out_of_vocabulary_id_is_a_capture_contract_error(where: str) -> None:
    prompt, completion = ([1, 32000], [2]) if where == "prompt" else ([1], [2, 32000])
    trace = make_trace(make_turn("ok", [1], [2]), make_turn("bad", prompt, completion))

    with pytest.raises(CaptureContractError) as caught:
        build_rows(trace, vocab_size=32000, session_id="sess-1")

    error = caught.value
    assert error.rules == ["out_of_vocabulary"]
    assert (error.node_id, error.session_id) == ("bad", "sess-1")
    assert "32000" in str(error) and "'bad'" in str(error) and "vocab size 32000" in str(error)


def test_ids_just_below_the_vocabulary_size_are_fine() -> None:
    (row,) = build_rows(make_trace(make_turn("n0", [31999], [31999])), vocab_size=32000)

    assert row.input_ids == [31999, 31999]


def sampled_at(turn: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    return {**turn, "metadata": {"sampling": sampling}}


def test_a_turn_sampled_at_another_temperature_is_a_capture_contract_error() -> None:
    trace = make_trace(
        sampled_at(make_turn("n0", [1], [2]), {"temperature": 1.0}),
        sampled_at(make_turn("n1", [1, 2, 3], [4]), {"temperature": 0.5, "top_p": 1.0}),
    )

    with pytest.raises(CaptureContractError) as caught:
        build_rows(trace, temperature=1.0, session_id="sess-1")

    error = caught.value
    assert error.rules == ["temperature_mismatch"]
    assert (error.node_id, error.session_id) == ("n1", "sess-1")
    assert "'n1'" in str(error) and "'sess-1'" in str(error)
    assert "temperature 0.5" in str(error) and "temperature 1.0" in str(error)


def test_turns_sampled_at_the_trainers_temperature_pass_after_a_json_round_trip() -> None:
    trace = make_trace(*(sampled_at(turn, {"temperature": 0.7}) for turn in append_only_chain(3)))
    trace = TrainingTrace.model_validate_json(trace.model_dump_json())

    assert build_rows(trace, temperature=0.7) == build_rows(trace)


@pytest.mark.parametrize("metadata", [{}, {"sampling": {}}, {"sampling": {"seed": 3}}])
def test_a_turn_that_records_no_sampling_temperature_is_accepted(metadata: dict[str, Any]) -> None:
    trace = make_trace({**make_turn("n0", [1], [2]), "metadata": metadata})

    assert len(build_rows(trace, temperature=1.0)) == 1


@pytest.mark.parametrize("recorded", [None, "0.7", True])
def test_a_recorded_temperature_that_is_not_a_number_is_a_capture_contract_error(recorded: Any) -> None:
    trace = make_trace(sampled_at(make_turn("n0", [1], [2]), {"temperature": recorded}))

    with pytest.raises(CaptureContractError) as caught:
        build_rows(trace, temperature=1.0)
    assert caught.value.rules == ["temperature_mismatch"]


def test_row_with_misaligned_lists_is_rejected() -> None:
    with pytest.raises(ValueError, match="must be as many"):
        Row(rollout=0, input_ids=[1, 2], targets=[0, 1], behaviour_logps=[0.0])


@st.composite
def random_forests(draw: st.DrawFn) -> TrainingTrace:
    """Turns continuing, branching from or rewriting earlier ones, over a tiny alphabet so that prefixes,
    ties and identical turns happen by chance; every logprob is unique, so it names its (turn, position)."""
    tokens = st.integers(0, 3)
    turns: list[dict[str, Any]] = []
    serial = 0
    for index in range(draw(st.integers(1, 8))):
        base: list[int] = []
        if turns and draw(st.booleans()):
            other = full(draw(st.sampled_from(turns)))
            base = other[: draw(st.integers(0, len(other)))]
        prompt = base + draw(st.lists(tokens, min_size=0 if base else 1, max_size=3))
        completion = draw(st.lists(tokens, max_size=4))
        mask = draw(st.lists(st.integers(0, 1), min_size=len(completion), max_size=len(completion)))
        logps = [-(serial + k + 1) / 64 for k in range(len(completion))]
        serial += len(completion)
        turns.append(make_turn(f"n{index}", prompt, completion, mask, logps))
    order = draw(st.permutations(range(len(turns))))
    return make_trace(*(turns[index] for index in order))


@settings(max_examples=300, deadline=None)
@given(random_forests())
def test_every_masked_sampled_token_is_a_target_exactly_once_at_its_position(trace: TrainingTrace) -> None:
    sequences = [turn.prompt_token_ids + turn.completion_token_ids for turn in trace.turns]
    owners = {
        logp: (turn, sequence, k)
        for turn, sequence in zip(trace.turns, sequences, strict=True)
        for k, logp in enumerate(turn.per_token_logps)
    }
    trained: Counter[tuple[str, int]] = Counter()

    rows = build_rows(trace, rollout=3)

    for row in rows:
        assert row.rollout == 3 and row.n_targets > 0
        assert row.input_ids in sequences
        for position, (target, logp) in enumerate(zip(row.targets, row.behaviour_logps, strict=True)):
            if not target:
                assert logp == 0.0
                continue
            assert target == 1
            turn, sequence, k = owners[logp]
            start = len(turn.prompt_token_ids)
            assert position == start + k
            assert row.input_ids[: len(sequence)] == sequence
            assert turn.loss_mask[start + k] == 1
            trained[(turn.node_id, k)] += 1
    masked = {
        (turn.node_id, k)
        for turn in trace.turns
        for k, bit in enumerate(turn.loss_mask[len(turn.prompt_token_ids) :])
        if bit
    }
    assert set(trained) == masked and set(trained.values()) <= {1}
    stats = row_stats(trace, rows)
    assert stats.trained_tokens == len(masked)
    prefixes = {tuple(sequence[:end]) for sequence in sequences for end in range(1, len(sequence) + 1)}
    assert stats.unique_tokens == len(prefixes)
