"""The prefix tree of training rows, and micro-batches planned on it. Pure, no torch.

A GRPO group's members run one task under one agent: their rows share the system prompt and the task
(~1,450 of ~1,600 ids in the dev loop's transcripts) and part from each other at the first sampled token
that differs. The warm-up's solver and distractor transcripts of a task do the same. Forwarding each row
whole computes the shared ids once per member; the rows' prefix tree (a radix tree: each node a run of ids
its rows all share, its children the rows parting after it) forwards each once
(:mod:`harness_trainer.trainer.step.shared_prefix`).

- :func:`prefix_tree`: the tree of some rows. A node shorter than ``min_span`` ids with no row ending at it
  is folded into its children (each forwards those few ids again): a forward of its own, with a cache copy
  per child, costs more than it saves.
- :func:`unique_tokens`: the ids of the exact tree (nothing folded), the least any forward can do.
- :func:`plan_shared_micro_batches`: rows into micro-batches of at most ``token_budget`` forwarded ids,
  counting a batch's shared prefixes once. Rows are taken in sorted order, which walks the tree depth
  first, so a cluster of rows that share a prefix stays together unless it exceeds the budget alone (then
  it is cut into consecutive runs, each forwarding the prefix again); the runs are packed
  first-fit-decreasing by their cost.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness_trainer.trainer.step.packing import first_fit_decreasing
from harness_trainer.trainer.step.rows import Row, common_prefix_length

MIN_SPAN = 32
"""Ids a node must share to get a forward of its own (see the module docstring)."""


@dataclass
class PrefixNode:
    """Ids ``[start, end)`` shared by every row in ``rows`` (indices into the rows the tree was built
    over), which also share everything before ``start`` (the path above). ``ending``: the rows whose last
    id is this node's last."""

    start: int
    end: int
    rows: list[int]
    ending: list[int] = field(default_factory=list)
    children: list[PrefixNode] = field(default_factory=list)

    @property
    def span(self) -> int:
        return self.end - self.start

    def walk(self) -> list[PrefixNode]:
        """This node and every node below it, parents before children."""
        nodes, stack = [], [self]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(reversed(node.children))
        return nodes


def prefix_tree(ids: Sequence[Sequence[int]], min_span: int = MIN_SPAN) -> PrefixNode:
    """The prefix tree of the sequences ``ids`` (each non-empty). Its root starts at 0 and has span 0 when
    the sequences share nothing worth a forward; every sequence ends at exactly one node, and the nodes on
    its path cover its ids once, in order.

    Raises:
        ValueError: an empty sequence, or ``min_span`` below 1.
    """
    if min_span < 1:
        raise ValueError(f"min_span must be at least 1, got {min_span}")
    for number, sequence in enumerate(ids):
        if not sequence:
            raise ValueError(f"sequence {number} is empty")
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    root = _node(ids, order, 0, min_span)
    if root.span < min_span and not root.ending:
        # Nothing worth sharing across every sequence: the root forwards nothing, its children everything.
        root.children = [_deepen(child, 0) for child in root.children]
        root.end = 0
    return root


def _node(ids: Sequence[Sequence[int]], members: list[int], start: int, min_span: int) -> PrefixNode:
    """The node of ``members`` (sorted by their ids, sharing ``ids[:start]``) and its subtree."""
    first, last = ids[members[0]], ids[members[-1]]
    end = common_prefix_length(first, last)  # sorted: the first and last share the least
    node = PrefixNode(start, end, list(members), [i for i in members if len(ids[i]) == end])
    rest = [i for i in members if len(ids[i]) > end]
    runs: list[list[int]] = []
    for index in rest:
        if runs and ids[runs[-1][0]][end] == ids[index][end]:
            runs[-1].append(index)
        else:
            runs.append([index])
    for run in runs:
        child = _node(ids, run, end, min_span)
        if child.span < min_span and not child.ending and child.children:
            # Too short to forward on its own: its children each forward its ids.
            node.children.extend(_deepen(grandchild, end) for grandchild in child.children)
        else:
            node.children.append(child)
    return node


def _deepen(node: PrefixNode, start: int) -> PrefixNode:
    """``node`` starting earlier, at ``start`` (its folded parent's ids become its own)."""
    node.start = start
    return node


def node_targets(node: PrefixNode, targets: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Each of ``node``'s rows' target positions that the node's own positions predict: ``t`` in
    ``(start, end]`` (``t - 1`` is in the node; ``t = start`` is predicted by its parent). ``targets``:
    every row's target positions, ascending."""
    found = {}
    for row in node.rows:
        ascending = targets[row]
        first, past = bisect_right(ascending, node.start), bisect_left(ascending, node.end + 1)
        found[row] = list(ascending[first:past])
    return found


def forwarded_tokens(tree: PrefixNode) -> int:
    """The ids a forward of ``tree`` computes: every node's span, once."""
    return sum(node.span for node in tree.walk())


def unique_tokens(ids: Sequence[Sequence[int]]) -> int:
    """The ids of the exact prefix tree of ``ids`` (a trie's node count): the least a forward can do.
    Sorted, each sequence adds what it does not share with the one before it."""
    ordered = sorted(ids)
    return sum(
        len(seq) - (common_prefix_length(ordered[i - 1], seq) if i else 0) for i, seq in enumerate(ordered)
    )


def plan_shared_micro_batches(
    rows: Sequence[Row], token_budget: int, min_span: int = MIN_SPAN
) -> list[list[Row]]:
    """``rows`` into micro-batches whose prefix trees forward at most ``token_budget`` ids each (see the
    module docstring). Deterministic; a row longer than the budget is alone in its micro-batch.

    Raises:
        ValueError: ``token_budget`` is below 1.
    """
    order = sorted(range(len(rows)), key=lambda i: (rows[i].input_ids, i))
    runs: list[list[int]] = []  # row indices, consecutive in sorted order
    costs: list[int] = []  # each run's forwarded ids
    previous: Sequence[int] = ()
    for index in order:
        ids = rows[index].input_ids
        shared = common_prefix_length(previous, ids)
        if runs and shared >= min_span and costs[-1] + len(ids) - shared <= token_budget:
            runs[-1].append(index)
            costs[-1] += len(ids) - shared
        else:
            runs.append([index])
            costs.append(len(ids))
        previous = ids
    packed = first_fit_decreasing(costs, token_budget)
    return [[rows[i] for run in members for i in runs[run]] for members in packed]
