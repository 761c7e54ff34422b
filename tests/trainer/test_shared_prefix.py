"""Shared-prefix logprobs: the packed forward's logprobs and gradients, each shared prefix forwarded once."""

from __future__ import annotations

import random

import pytest
import torch

from harness_trainer.trainer.step.logprobs import token_logprobs, use_packed_attention
from harness_trainer.trainer.step.packing import collate
from harness_trainer.trainer.step.rows import Row
from harness_trainer.trainer.step.shared_prefix import prefix_groups, shared_prefix_logprobs


def row(rollout: int, ids: list[int], targets: list[int]) -> Row:
    return Row(rollout, ids, targets, [0.0] * len(ids))


def tail_targets(length: int, trained: int) -> list[int]:
    return [0] * (length - trained) + [1] * trained


def forest() -> list[Row]:
    """A solver/distractor-like pair sharing 60 of ~75 ids (targets in both tails, and two inside the shared
    part), a third row sharing 60 ids with them too, and a row that shares only its first id."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 4000) for _ in range(60)]
    a = shared + [rng.randrange(1, 4000) for _ in range(15)]
    b = shared + [rng.randrange(1, 4000) for _ in range(9)]
    c = shared + [rng.randrange(1, 4000) for _ in range(21)]
    lone = [shared[0]] + [rng.randrange(1, 4000) for _ in range(40)]
    in_shared = [0] * 50 + [1, 1] + [0] * 8  # a sampled turn inside the common prefix, trained in a and c
    return [
        row(0, a, in_shared + [1] * 15),
        row(1, b, [0] * 60 + [1] * 9),
        row(0, c, in_shared + [0] * 5 + [1] * 16),
        row(2, lone, tail_targets(41, 12)),
    ]


def test_rows_are_grouped_by_a_prefix_that_is_most_of_each_row_and_each_keeps_a_tail():
    rows = forest()
    groups = prefix_groups(rows)
    assert sorted((sorted(members), shared) for members, shared in groups) == [([0, 1, 2], 60), ([3], 0)]
    # Identical rows share all but their last id: the prefix's last position predicts it.
    same = [row(0, [5, 6, 7, 8], [0, 0, 1, 1]), row(1, [5, 6, 7, 8], [0, 0, 1, 1])]
    assert prefix_groups(same) == [([0, 1], 3)]
    # 60 shared ids are 80 % of the longest row: under a 90 % bar every row goes alone.
    alone = prefix_groups(rows, min_fraction=0.9)
    assert sorted(members for members, _ in alone) == [[0], [1], [2], [3]] and {s for _, s in alone} == {0}


def test_logprobs_and_gradients_equal_the_packed_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rows = forest()
    packed_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    use_packed_attention(packed_model)
    shared_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    weights = {0: 0.5, 1: 0.3, 2: 0.2}
    batch = collate(rows, {index: 1.0 for index in weights}, weights)
    packed, _ = token_logprobs(packed_model, batch, 0.7, with_entropy=False, targets_only=True)
    (packed * batch.token_weights).sum().backward()

    per_row = shared_prefix_logprobs(shared_model, rows, temperature=0.7)
    torch.stack(
        [weights[r.rollout] * logps.sum() for r, logps in zip(rows, per_row, strict=True)]
    ).sum().backward()

    assert [len(logps) for logps in per_row] == [r.n_targets for r in rows]
    expected = packed[batch.targets].detach()
    assert torch.allclose(torch.cat(per_row).detach(), expected, atol=1e-5)
    for (name, p), q in zip(packed_model.named_parameters(), shared_model.parameters(), strict=True):
        # Float rounding differs (other matmul shapes): compare each gradient against its own size.
        assert float((p.grad - q.grad).norm()) <= 1e-4 * float(p.grad.norm()), name


def test_a_row_whose_first_id_is_a_target_is_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="row 0: its first id is a target"):
        shared_prefix_logprobs(model, [row(0, [1, 2], [1, 1])])
    with pytest.raises(ValueError, match="temperature must be positive"):
        shared_prefix_logprobs(model, [row(0, [1, 2], [0, 1])], temperature=0.0)
