"""Target logprobs of rows that share long prefixes, forwarding each shared prefix once.

The warm-up's transcripts come in pairs (a task's solver and its distractor) whose first ~1,400 tokens, the
agent's system prompt and the task, are the same ids: a packed forward computes them twice, and they are
most of every row. :func:`shared_prefix_logprobs` groups rows by their longest common prefix, forwards a
group's prefix once (batch 1, keeping its key/value cache), then every member's rest as one padded batch
on the prefix's cache repeated per member. Gradients flow through the cache into the prefix, so the
logprobs, and their gradients, are the packed forward's (the tests compare them), at fewer forwarded tokens.

For causal decoder LMs whose ``model.model`` (the decoder) takes ``past_key_values``, ``attention_mask``
and ``position_ids``, and whose ``lm_head`` maps its hidden states to logits: Qwen2, Llama and the like.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from harness_trainer.trainer.step.rows import Row, common_prefix_length

MIN_SHARED_FRACTION = 0.5
"""Rows join a group when their common prefix is at least this fraction of the row: less is not worth a
forward of its own and a padded batch (the warm-up's transcripts of different tasks share a 250-token
system prompt out of ~1,600; a task's solver and distractor share ~1,450)."""


def prefix_groups(
    rows: Sequence[Row], min_fraction: float = MIN_SHARED_FRACTION
) -> list[tuple[list[int], int]]:
    """``rows`` (by index) grouped by shared prefix: ``(members, prefix_length)`` pairs covering every row
    once. Members of a group share their first ``prefix_length`` ids (at least ``min_fraction`` of each
    member), and each has at least one id after them; a row that shares less with its neighbours is a
    group of one with prefix length 0."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].input_ids)
    runs: list[list[int]] = []
    for index in order:
        # Sorted, a row shares no more with the run's first row than the rows between them do.
        ids = rows[index].input_ids
        if runs and common_prefix_length(rows[runs[-1][0]].input_ids, ids) >= min_fraction * len(ids):
            runs[-1].append(index)
        else:
            runs.append([index])
    groups: list[tuple[list[int], int]] = []
    for members in runs:
        if len(members) == 1:
            groups.append((members, 0))
            continue
        shared = common_prefix_length(rows[members[0]].input_ids, rows[members[-1]].input_ids)
        # Each member keeps at least its last id out of the prefix: the prefix's last position predicts it.
        groups.append((members, min(shared, *(len(rows[i].input_ids) - 1 for i in members))))
    return groups


def shared_prefix_logprobs(
    model: torch.nn.Module,
    rows: Sequence[Row],
    temperature: float = 1.0,
    min_fraction: float = MIN_SHARED_FRACTION,
) -> list[torch.Tensor]:
    """Each row's logprobs at its target positions, in order (one tensor per row, differentiable), each
    shared prefix forwarded once (see the module docstring).

    Raises:
        ValueError: ``temperature`` is not positive, or a row's first id is a target (nothing predicts it).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    for number, row in enumerate(rows):
        if row.targets and row.targets[0]:
            raise ValueError(f"row {number}: its first id is a target, and nothing predicts a first id")
    out: list[torch.Tensor | None] = [None] * len(rows)
    for members, shared in prefix_groups(rows, min_fraction):
        group = _group_logprobs(model, [rows[i] for i in members], shared, temperature)
        for index, logps in zip(members, group, strict=True):
            out[index] = logps
    return [logps for logps in out if logps is not None]


def _group_logprobs(
    model: torch.nn.Module, rows: list[Row], shared: int, temperature: float
) -> list[torch.Tensor]:
    from transformers import DynamicCache

    decoder, head = model.model, model.lm_head
    # transformers renamed ``past_key_values`` to ``cache``; use whichever this version takes.
    cache_name = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    device = next(model.parameters()).device
    cache = DynamicCache() if shared else None
    prefix_hidden = torch.zeros(0, model.config.hidden_size, device=device)
    if cache is not None:
        prefix = torch.tensor([rows[0].input_ids[:shared]], device=device)
        prefix_hidden = decoder(input_ids=prefix, use_cache=True, **{cache_name: cache}).last_hidden_state[0]
        cache.batch_repeat_interleave(len(rows))
    rests = [row.input_ids[shared:] for row in rows]
    width = max(len(rest) for rest in rests)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), shared + width, dtype=torch.long, device=device)
    mask[:, :shared] = 1
    for number, rest in enumerate(rests):
        ids[number, : len(rest)] = torch.tensor(rest, device=device)
        mask[number, shared : shared + len(rest)] = 1
    positions = torch.arange(shared, shared + width, device=device).expand(len(rows), width)
    hidden = decoder(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **{cache_name: cache},
        use_cache=shared > 0,
    ).last_hidden_state
    result = []
    for number, row in enumerate(rows):
        # The row's hidden states in order (its prefix's, then its own), so position t - 1 predicts t.
        states = torch.cat([prefix_hidden, hidden[number]])
        targets = torch.tensor(
            [t for t, is_target in enumerate(row.targets) if is_target], dtype=torch.long, device=device
        )
        logits = head(states[targets - 1]).float() / temperature
        chosen = torch.tensor(row.input_ids, device=device)[targets]
        result.append(logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1))
    return result
