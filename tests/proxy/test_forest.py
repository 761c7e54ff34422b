"""The prefix forest's parent rule (``capture_proxy.forest``), on id lists and on packed ids."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.forest import leaves, parents


def forest(*calls: tuple[list[int], list[int]]) -> list[int | None]:
    return parents([prompt for prompt, _ in calls], [completion for _, completion in calls])


def test_an_append_only_conversation_is_a_chain() -> None:
    assert forest(([1], [2]), ([1, 2, 3], [4]), ([1, 2, 3, 4, 5], [6])) == [None, 0, 1]


def test_the_longest_prefix_wins_over_a_shorter_ancestor() -> None:
    assert forest(([1], [2]), ([1, 2, 3], [4]), ([1, 2, 3, 4, 5], [])) == [None, 0, 1]
    assert forest(([1], [2]), ([1, 2, 3], [9]), ([1, 2, 3, 4, 5], [])) == [None, 0, 0]


def test_a_call_with_no_earlier_prefix_is_a_root() -> None:
    # The second call rewrote the history (compaction): nothing before it is its prefix.
    assert forest(([1, 2], [3]), ([7, 8], [9]), ([7, 8, 9, 1], [2])) == [None, None, 1]


def test_ties_go_to_the_lowest_index() -> None:
    twins = ([1, 2], [3])
    assert forest(twins, twins, ([1, 2, 3, 4], [5]), twins) == [None, None, 0, None]


def test_a_call_with_the_same_prompt_is_a_sibling_not_a_parent() -> None:
    # Empty completions: each call's full sequence is the other's prompt, yet neither is a parent.
    assert forest(([1, 2], []), ([1, 2], [])) == [None, None]
    assert forest(([1], [2]), ([1, 2], []), ([1, 2], [3])) == [None, 0, 0]


def test_a_parent_may_come_after_its_child() -> None:
    assert forest(([1, 2, 3], [4]), ([1], [2])) == [1, None]


def test_an_empty_forest_has_no_parents_and_no_leaves() -> None:
    assert parents([], []) == []
    assert leaves([]) == []


def test_prompts_and_completions_must_be_as_many() -> None:
    with pytest.raises(ValueError, match="as many"):
        parents([[1]], [])


def test_leaves_are_the_calls_no_call_continues_in_index_order() -> None:
    assert leaves([None, 0, 0, None, 1]) == [2, 3, 4]


CALL = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=5), st.lists(st.integers(0, 2), max_size=3)
)  # a tiny vocabulary makes chance prefixes, ties and siblings common


@settings(max_examples=300, deadline=None)
@given(st.lists(CALL, max_size=12))
def test_parents_match_the_rule_by_brute_force(calls: list[tuple[list[int], list[int]]]) -> None:
    expected: list[int | None] = []
    for prompt, _ in calls:
        best: int | None = None
        for index, (other_prompt, other_completion) in enumerate(calls):
            full = other_prompt + other_completion
            prefix = len(other_prompt) < len(prompt) and prompt[: len(full)] == full
            if prefix and (best is None or len(full) > len(calls[best][0]) + len(calls[best][1])):
                best = index
        expected.append(best)
    assert forest(*calls) == expected
    packed = [
        (array("I", prompt).tobytes(), array("I", completion).tobytes()) for prompt, completion in calls
    ]
    assert parents([prompt for prompt, _ in packed], [completion for _, completion in packed]) == expected
