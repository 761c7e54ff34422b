"""The prefix forest of a session's engine calls: which call each call continues. Pure, stdlib only.

This is the one statement of the parent rule, shared by the proxy (``capture_proxy.assembly`` exports a
TrainingTrace from it) and the trainer (``harness_trainer.trainer.step.rows`` builds training rows from it),
so the two can never disagree about what a conversation's history was.

Contract of :func:`parents`: call ``i`` is given as its prompt ids ``prompts[i]`` and completion ids
``completions[i]``, in call order, either all as lists of ints or all as ``bytes`` packed at one fixed
width (``array("I", ids).tobytes()``: equal ids give equal bytes, and every length scales alike, so the
answer is the same; slicing bytes is a memcpy and comparing them a memcmp, many times faster than lists
of ints, which matters to a caller that packs anyway). Ids are only compared for equality. Its parent is
the index of the *other* call whose prompt+completion ids are the longest exact prefix of its prompt ids,
or None when there is none (a root):

- **Ties** (identical full sequences) go to the lowest index, so a caller that lists calls in call order
  sends every child of repeated calls to the earliest one.
- **A call with the same prompt is a sibling, never a parent**: a parent's prompt is strictly shorter than
  its child's. So a call with an empty completion cannot be its sibling's parent, and there are no cycles.
- **A rewritten history** (compaction, stripped reasoning) has no earlier call as its prefix: it is a root.
- Parents depend on the ids and the index order only.

Cost: calls are bucketed by full length and a call's parent is searched from the longest candidate length
down, comparing slices, completion first since that is where unrelated calls differ. In an append-only
conversation the first candidate tried is the parent, so the search is linear in the total number of
prompt ids.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from typing import TypeVar

Ids = TypeVar("Ids", list[int], bytes)
"""A call's ids: a list of ints, or bytes packed at one fixed width (the same for every call)."""


def parents(prompts: Sequence[Ids], completions: Sequence[Ids]) -> list[int | None]:
    """Each call's parent index, or None for a root (rule in the module docstring).

    Raises:
        ValueError: ``prompts`` and ``completions`` are not as many.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts and {len(completions)} completions must be as many")
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        by_length[len(prompt) + len(completion)].append(index)  # in index order: the tie-break
    lengths = sorted(by_length)
    return [_longest_prefix(prompt, prompts, completions, by_length, lengths) for prompt in prompts]


def leaves(parent: Sequence[int | None]) -> list[int]:
    """The indices no call has as its parent, in index order (``parent`` as :func:`parents` returns it)."""
    has_child = [False] * len(parent)
    for index in parent:
        if index is not None:
            has_child[index] = True
    return [index for index, inner in enumerate(has_child) if not inner]


def _longest_prefix(
    prompt: Ids,
    prompts: Sequence[Ids],
    completions: Sequence[Ids],
    by_length: dict[int, list[int]],
    lengths: list[int],
) -> int | None:
    # Only full lengths up to the prompt's can be its prefix; the longest that is one wins.
    for position in range(bisect_right(lengths, len(prompt)) - 1, -1, -1):
        end = lengths[position]
        for candidate in by_length[end]:
            start = len(prompts[candidate])
            if (
                start < len(prompt)  # not itself, not a sibling
                and prompt[start:end] == completions[candidate]
                and prompt[:start] == prompts[candidate]
            ):
                return candidate
    return None
