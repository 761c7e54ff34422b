"""Training rows from a TrainingTrace, on the engine's own token ids (never retokenized). Pure, no torch.

A trace's turns form a prefix forest (:mod:`capture_proxy.forest`, the rule the proxy assembles traces by):

- **Parent.** A turn's parent is the other turn whose prompt+completion ids are the longest exact prefix of
  its prompt ids; ties (identical full sequences) go to the earliest turn in trace order. A turn with the
  same prompt is a sibling, never a parent, so a prompt-only turn cannot make a cycle. A turn without a
  parent is a root: a rewritten history (compaction, stripped reasoning) starts a new tree. A parent may
  come after its child in the trace: only ties depend on the order.
- **Rows.** One row per leaf (a turn no other turn has as parent), in leaf call order: the leaf's full
  sequence, forwarded once. The completion of every turn on the root-to-leaf path sits at a known place
  in it, so its mask bits become targets there and its logprobs the behaviour logprobs. A fork (two
  turns sharing a parent) therefore gives one row per branch.
- **Each sampled token is trained once.** A turn's completion is a target only in the first row whose
  path contains it; in later rows it is context. Rows left with no target (a zero-masked auxiliary leaf)
  are dropped.

Cost: the parent search (:mod:`capture_proxy.forest`) is linear in the trace's tokens for an append-only
conversation, which gives one row; forwarded tokens equal unique tokens there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from capture_proxy.forest import leaves, parents
from harness_trainer.trace import CaptureContractError, TrainingTrace, TrainingTurn


@dataclass
class Row:
    """One forward sequence: a root-to-leaf path of a rollout's prefix tree.

    ``input_ids``, ``targets`` and ``behaviour_logps`` have one entry per position (checked on
    construction). ``targets[t]`` is 1 where ``input_ids[t]`` is a sampled token trained in this row;
    ``behaviour_logps[t]`` is the engine's logprob for it there, and 0.0 wherever ``targets[t]`` is 0.
    """

    rollout: int
    """Caller-assigned index of the rollout (within the step) this row comes from."""
    input_ids: list[int]
    targets: list[int]
    behaviour_logps: list[float]

    def __post_init__(self) -> None:
        if not len(self.input_ids) == len(self.targets) == len(self.behaviour_logps):
            raise ValueError(
                f"row of rollout {self.rollout}: {len(self.input_ids)} input ids, {len(self.targets)} "
                f"targets and {len(self.behaviour_logps)} behaviour logprobs must be as many"
            )

    @property
    def n_targets(self) -> int:
        """How many positions of this row are trained."""
        return sum(self.targets)


@dataclass
class RowStats:
    """How much a rollout's rows forward compared with the tokens its prefix forest holds."""

    rows: int
    roots: int
    """Trees in the forest: 1 for an append-only history, one more per rewritten history."""
    forwarded_tokens: int
    """Sum of ``len(input_ids)`` over the rows."""
    unique_tokens: int
    """Distinct positions of the trie formed by all turns' full sequences."""
    trained_tokens: int
    """Sum of the rows' targets."""


def build_rows(
    trace: TrainingTrace,
    rollout: int = 0,
    *,
    vocab_size: int | None = None,
    temperature: float | None = None,
    session_id: str | None = None,
) -> list[Row]:
    """The rollout's training rows, one per leaf that has something to train (rules in the module docstring).

    Raises:
        CaptureContractError: with ``vocab_size`` given, an id (prompt or completion) is not below it
            (rule ``out_of_vocabulary``); with ``temperature`` given (the one the trainer computes logprobs
            at), a turn's recorded ``metadata["sampling"]["temperature"]`` is another (rule
            ``temperature_mismatch``). A turn that records no sampling temperature is accepted.
    """
    turns = trace.turns
    if vocab_size is not None:
        _check_vocabulary(turns, vocab_size, session_id)
    if temperature is not None:
        _check_temperature(turns, temperature, session_id)
    parent = _parents(turns)
    claimed = [False] * len(turns)
    rows: list[Row] = []
    for leaf in leaves(parent):
        # A claimed turn's ancestors were claimed with it (by the same earlier row), so the walk stops
        # there: every turn is walked once in all, however many leaves share it.
        path: list[int] = []
        node: int | None = leaf
        while node is not None and not claimed[node]:
            claimed[node] = True
            path.append(node)
            node = parent[node]
        row = _row(turns, leaf, path, rollout)
        if row.n_targets:
            rows.append(row)
    return rows


def row_stats(trace: TrainingTrace, rows: list[Row]) -> RowStats:
    """Counts for logging; ``forwarded_tokens / unique_tokens`` is 1.0 for an append-only history."""
    sequences = [turn.prompt_token_ids + turn.completion_token_ids for turn in trace.turns]
    return RowStats(
        rows=len(rows),
        roots=sum(parent is None for parent in _parents(trace.turns)),
        forwarded_tokens=sum(len(row.input_ids) for row in rows),
        unique_tokens=_trie_size(sequences),
        trained_tokens=sum(row.n_targets for row in rows),
    )


def _check_vocabulary(turns: Sequence[TrainingTurn], vocab_size: int, session_id: str | None) -> None:
    for turn in turns:
        for ids in (turn.prompt_token_ids, turn.completion_token_ids):
            if ids and max(ids) >= vocab_size:
                bad = next(token for token in ids if token >= vocab_size)
                session = f"session {session_id!r}" if session_id is not None else "an unnamed session"
                raise CaptureContractError(
                    f"token id {bad} of node {turn.node_id!r} in {session} is out of the model's "
                    f"vocabulary (vocab size {vocab_size}): the engine and the trainer hold different models",
                    rules=["out_of_vocabulary"],
                    session_id=session_id,
                    node_id=turn.node_id,
                )


def _check_temperature(turns: Sequence[TrainingTurn], temperature: float, session_id: str | None) -> None:
    # The behaviour logprobs were processed at the recorded temperature: trained at another, the ratio
    # compares two different distributions, so the run stops as for any broken capture contract.
    for turn in turns:
        sampling = turn.metadata.get("sampling")
        if not isinstance(sampling, dict) or "temperature" not in sampling:
            continue  # older traces and hand-built ones record no sampling
        recorded = sampling["temperature"]
        number = isinstance(recorded, int | float) and not isinstance(recorded, bool)
        if number and math.isclose(recorded, temperature, rel_tol=1e-9):
            continue
        session = f"session {session_id!r}" if session_id is not None else "an unnamed session"
        raise CaptureContractError(
            f"node {turn.node_id!r} of {session} was sampled at temperature {recorded!r} but the trainer "
            f"computes logprobs at temperature {temperature!r}: its behaviour logprobs describe another "
            "distribution than the one trained on; give the sessions the trainer's sampling policy",
            rules=["temperature_mismatch"],
            session_id=session_id,
            node_id=turn.node_id,
        )


def _parents(turns: Sequence[TrainingTurn]) -> list[int | None]:
    """Each turn's parent index, or None for a root (see the module docstring)."""
    return parents([turn.prompt_token_ids for turn in turns], [turn.completion_token_ids for turn in turns])


def _row(turns: Sequence[TrainingTurn], leaf: int, path: list[int], rollout: int) -> Row:
    """The leaf's sequence, with targets from the completions of ``path`` (the turns not yet trained)."""
    leaf_turn = turns[leaf]
    input_ids = leaf_turn.prompt_token_ids + leaf_turn.completion_token_ids
    targets = [0] * len(input_ids)
    logps = [0.0] * len(input_ids)
    for index in path:
        turn = turns[index]
        # The turn's full sequence is a prefix of the leaf's, so its completion sits at the same positions.
        start = len(turn.prompt_token_ids)
        end = start + len(turn.completion_token_ids)
        mask = turn.loss_mask[start:]
        targets[start:end] = mask
        if all(mask):
            logps[start:end] = turn.per_token_logps
        else:
            logps[start:end] = [
                logp if bit else 0.0 for logp, bit in zip(turn.per_token_logps, mask, strict=True)
            ]
    return Row(rollout=rollout, input_ids=input_ids, targets=targets, behaviour_logps=logps)


def _trie_size(sequences: list[list[int]]) -> int:
    """Nodes of the trie of ``sequences``: in sorted order, each adds what it does not share with the last."""
    size = 0
    previous: list[int] = []
    for sequence in sorted(sequences):
        size += len(sequence) - common_prefix_length(previous, sequence)
        previous = sequence
    return size


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share. Bisects on slice equality, halving the compared span
    each step: O(len) in C, not a Python loop."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low
