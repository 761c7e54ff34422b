"""Padding-free packing: training rows planned into micro-batches of at most ``token_budget`` tokens, each
collated into one ``[1, T]`` sequence with no padding.

Contract of a packed micro-batch (:class:`MicroBatch`): rows are concatenated in plan order; ``position_ids``
restart at 0 at each row start, which is how the model tells rows apart (transformers 5 builds a
block-diagonal causal mask from the position ids when no attention mask and no cache are given, see
:mod:`harness_trainer.trainer.step.logprobs`). Every per-token field is aligned with ``input_ids``:
``targets[t]`` marks a trained sampled token ``input_ids[t]``, predicted from position ``t - 1`` of the same
row, so a row's first token is never a target. ``token_weights`` carry the per-rollout normalisation of the
loss (the weight of the token's rollout at targets, 0 elsewhere), so the loss of a micro-batch is a plain
weighted sum.

The plan is first-fit-decreasing by row length, deterministic for the same rows in the same order; a row
longer than the budget gets a micro-batch of its own. :func:`collate_padded` is the padded ``[B, L]``
layout, kept as the baseline the packing benchmark measures against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from harness_trainer.trainer.step.rows import Row


@dataclass
class MicroBatch:
    """Rows packed into one padding-free sequence; every per-token tensor has ``T`` entries."""

    input_ids: torch.Tensor  # [1, T] long: the rows concatenated
    position_ids: torch.Tensor  # [1, T] long: 0 at each row start
    targets: torch.Tensor  # [T] bool
    behaviour_logps: torch.Tensor  # [T] float32: the engine's logprob at targets, 0 elsewhere
    advantages: torch.Tensor  # [T] float32: the token's rollout advantage
    token_weights: torch.Tensor  # [T] float32: the token's rollout weight at targets, 0 elsewhere
    rollouts: torch.Tensor  # [T] long: rollout index per token
    row_lengths: list[int]

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def n_targets(self) -> int:
        return int(self.targets.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same batch with every tensor on ``device``."""
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            targets=self.targets.to(device),
            behaviour_logps=self.behaviour_logps.to(device),
            advantages=self.advantages.to(device),
            token_weights=self.token_weights.to(device),
            rollouts=self.rollouts.to(device),
            row_lengths=list(self.row_lengths),
        )


@dataclass
class PaddedBatch:
    """Rows right-padded to the longest one (the benchmark baseline); per-token tensors are ``[B, L]``."""

    input_ids: torch.Tensor  # [B, L] long, pad_id after each row
    attention_mask: torch.Tensor  # [B, L] long: 1 on real tokens
    targets: torch.Tensor  # [B, L] bool, False on padding
    behaviour_logps: torch.Tensor  # [B, L] float32
    advantages: torch.Tensor  # [B, L] float32
    token_weights: torch.Tensor  # [B, L] float32, 0 on padding
    rollouts: torch.Tensor  # [B, L] long
    row_lengths: list[int]

    @property
    def n_tokens(self) -> int:
        """Real tokens, padding excluded."""
        return sum(self.row_lengths)

    @property
    def n_targets(self) -> int:
        return int(self.targets.sum())


def plan_micro_batches(rows: Sequence[Row], token_budget: int) -> list[list[Row]]:
    """Group ``rows`` into micro-batches of at most ``token_budget`` tokens, first-fit-decreasing.

    Deterministic: rows of equal length keep their input order. A row longer than the budget is alone in
    its micro-batch.

    Raises:
        ValueError: ``token_budget`` is below 1.
    """
    bins = first_fit_decreasing([len(row.input_ids) for row in rows], token_budget)
    return [[rows[i] for i in members] for members in bins]


def first_fit_decreasing(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Item indices packed into bins of at most ``budget``, largest first (ties in index order), each into
    the first bin it fits; an item over the budget gets a bin of its own.

    Raises:
        ValueError: ``budget`` is below 1.
    """
    if budget < 1:
        raise ValueError(f"token_budget must be at least 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []  # still free per bin; negative for an oversize item, so nothing joins it
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, free in enumerate(room):
            if sizes[i] <= free:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(budget - sizes[i])
    return bins


def collate(
    rows: Sequence[Row], advantages: Mapping[int, float], rollout_weights: Mapping[int, float]
) -> MicroBatch:
    """Pack ``rows`` into one padding-free micro-batch.

    ``advantages`` and ``rollout_weights`` map a rollout index to its advantage and its loss weight
    (``1 / (N_r · R)``: see :func:`harness_trainer.trainer.step.loss.policy_loss`).

    Raises:
        ValueError: no rows, a rollout missing from either mapping, or a row whose first token is a target.
    """
    fields = _row_fields(rows, advantages, rollout_weights)
    lengths = [len(row.input_ids) for row in rows]
    return MicroBatch(
        input_ids=torch.cat(fields["input_ids"]).unsqueeze(0),
        position_ids=torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
        targets=torch.cat(fields["targets"]),
        behaviour_logps=torch.cat(fields["behaviour_logps"]),
        advantages=torch.cat(fields["advantages"]),
        token_weights=torch.cat(fields["token_weights"]),
        rollouts=torch.cat(fields["rollouts"]),
        row_lengths=lengths,
    )


def collate_padded(
    rows: Sequence[Row],
    advantages: Mapping[int, float],
    rollout_weights: Mapping[int, float],
    pad_id: int = 0,
) -> PaddedBatch:
    """Right-pad ``rows`` into a ``[B, L]`` batch with an attention mask (the packing baseline).

    Raises:
        ValueError: as :func:`collate`.
    """
    fields = _row_fields(rows, advantages, rollout_weights)
    lengths = [len(row.input_ids) for row in rows]
    padded = {name: pad_sequence(values, batch_first=True) for name, values in fields.items()}
    mask = pad_sequence([torch.ones(n, dtype=torch.long) for n in lengths], batch_first=True)
    return PaddedBatch(
        input_ids=pad_sequence(fields["input_ids"], batch_first=True, padding_value=pad_id),
        attention_mask=mask,
        targets=padded["targets"],
        behaviour_logps=padded["behaviour_logps"],
        advantages=padded["advantages"],
        token_weights=padded["token_weights"],
        rollouts=padded["rollouts"],
        row_lengths=lengths,
    )


def _row_fields(
    rows: Sequence[Row], advantages: Mapping[int, float], rollout_weights: Mapping[int, float]
) -> dict[str, list[torch.Tensor]]:
    """Each row's per-token tensors, by field name; what both layouts are built from."""
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    for name, mapping in (("advantages", advantages), ("rollout_weights", rollout_weights)):
        missing = sorted({row.rollout for row in rows} - mapping.keys())
        if missing:
            raise ValueError(f"{name} has no entry for rollout(s) {missing}")
    fields: dict[str, list[torch.Tensor]] = {
        name: []
        for name in ("input_ids", "targets", "behaviour_logps", "advantages", "token_weights", "rollouts")
    }
    for row in rows:
        if row.targets and row.targets[0]:
            # Nothing in the row predicts its first token, so it cannot be trained.
            raise ValueError(f"a row of rollout {row.rollout} has a target at its first token")
        n = len(row.input_ids)
        targets = torch.tensor(row.targets, dtype=torch.bool)
        fields["input_ids"].append(torch.tensor(row.input_ids, dtype=torch.long))
        fields["targets"].append(targets)
        fields["behaviour_logps"].append(torch.tensor(row.behaviour_logps, dtype=torch.float32))
        fields["advantages"].append(torch.full((n,), float(advantages[row.rollout]), dtype=torch.float32))
        weight = torch.full((n,), float(rollout_weights[row.rollout]), dtype=torch.float32)
        fields["token_weights"].append(weight * targets)
        fields["rollouts"].append(torch.full((n,), row.rollout, dtype=torch.long))
    return fields
