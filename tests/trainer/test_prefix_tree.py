"""The rows' prefix tree and the micro-batches planned on it (pure)."""

from __future__ import annotations

import random

import pytest

from harness_trainer.trainer.step.prefix_tree import (
    forwarded_tokens,
    plan_shared_micro_batches,
    prefix_tree,
    unique_tokens,
)
from harness_trainer.trainer.step.rows import Row


def row(rollout: int, ids: list[int]) -> Row:
    return Row(rollout, ids, [0] + [1] * (len(ids) - 1), [0.0] * len(ids))


def group(rng: random.Random, members: int, prompt: int, rest: tuple[int, int]) -> list[list[int]]:
    """A GRPO group: one prompt, then each member's own completion (a few share their first ids)."""
    shared = [rng.randrange(1, 4000) for _ in range(prompt)]
    opening = [rng.randrange(1, 4000) for _ in range(40)]
    out = []
    for member in range(members):
        head = opening if member % 2 else []  # half the members open alike, then part
        out.append(shared + head + [rng.randrange(1, 4000) for _ in range(rng.randint(*rest))])
    return out


def paths(tree, count: int) -> list[list[tuple[int, int]]]:
    """Each sequence's nodes ``(start, end)`` from the root down to where it ends."""
    found: list[list[tuple[int, int]]] = [[] for _ in range(count)]

    def visit(node, above: list[tuple[int, int]]) -> None:
        here = [*above, (node.start, node.end)] if node.span else above
        for index in node.ending:
            found[index] = here
        for child in node.children:
            visit(child, here)

    visit(tree, [])
    return found


def test_every_sequence_ends_once_and_its_path_covers_its_ids_in_order():
    rng = random.Random(0)
    ids = group(rng, 4, 300, (20, 80)) + group(rng, 8, 200, (5, 60)) + [[7, 8, 9]]
    ids.append(list(ids[0]))  # a member sampled twice alike
    ids.append(ids[1][:310])  # a row that is a prefix of another
    tree = prefix_tree(ids, min_span=16)
    found = paths(tree, len(ids))
    for index, sequence in enumerate(ids):
        covered = [t for start, end in found[index] for t in range(start, end)]
        assert covered == list(range(len(sequence))), index
    for node in tree.walk():
        for index in node.rows:  # every row of a node has the node's ids
            assert ids[index][node.start : node.end] == ids[node.rows[0]][node.start : node.end]
    assert sorted(i for node in tree.walk() for i in node.ending) == list(range(len(ids)))


def test_a_groups_prompt_is_forwarded_once_and_short_shared_runs_are_folded():
    rng = random.Random(1)
    ids = group(rng, 8, 1450, (50, 300))
    exact = unique_tokens(ids)
    assert exact == 1450 + 40 + sum(len(s) - 1450 - (40 if m % 2 else 0) for m, s in enumerate(ids))
    assert forwarded_tokens(prefix_tree(ids, min_span=1)) == exact
    # Folded at 64: the 40 ids four members open with are forwarded by each of them.
    folded = prefix_tree(ids, min_span=64)
    assert forwarded_tokens(folded) == exact + 3 * 40
    assert folded.span == 1450 and all(child.start == 1450 for child in folded.children)
    # Two groups of different tasks share nothing worth a forward: the root forwards nothing.
    two = prefix_tree(ids + group(rng, 4, 900, (10, 20)), min_span=64)
    assert two.span == 0 and [child.span for child in two.children if len(child.rows) > 1] != []


def test_unique_tokens_is_the_trie_size():
    assert unique_tokens([[1, 2, 3], [1, 2, 4], [1, 5], [6]]) == 3 + 1 + 1 + 1
    assert unique_tokens([[1, 2], [1, 2]]) == 2


def test_planned_micro_batches_keep_a_group_together_and_count_its_prefix_once():
    rng = random.Random(2)
    groups = [group(rng, 4, 1000, (50, 150)) for _ in range(3)]
    rows = [row(g * 10 + m, ids) for g, members in enumerate(groups) for m, ids in enumerate(members)]
    plan = plan_shared_micro_batches(rows, token_budget=1800)
    assert sorted(r.rollout for batch in plan for r in batch) == sorted(r.rollout for r in rows)
    for batch in plan:  # each group fits in 1,800 forwarded ids only with its prompt counted once
        assert len({r.rollout // 10 for r in batch}) == 1 and len(batch) == 4
        assert forwarded_tokens(prefix_tree([r.input_ids for r in batch])) <= 1800
    # A budget under a group's forwarded ids cuts it in consecutive runs, each forwarding the prompt again.
    cut = plan_shared_micro_batches(rows[:4], token_budget=1250)
    assert 2 <= len(cut) < 4 and sorted(r.rollout for b in cut for r in b) == [0, 1, 2, 3]
    for batch in cut:
        assert forwarded_tokens(prefix_tree([r.input_ids for r in batch])) <= 1250
    # A row longer than the budget is alone.
    long = row(0, list(range(1, 50)))
    assert plan_shared_micro_batches([long], token_budget=10) == [[long]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="token_budget must be at least 1"):
        plan_shared_micro_batches([], token_budget=0)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        prefix_tree([[1], []])
    with pytest.raises(ValueError, match="min_span must be at least 1"):
        prefix_tree([[1]], min_span=0)
