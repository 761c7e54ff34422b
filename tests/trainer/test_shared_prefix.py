"""Shared-prefix logprobs: the packed forward's logprobs and gradients, each shared prefix forwarded once."""

from __future__ import annotations

import random

import pytest
import torch

from harness_trainer.trainer.step.logprobs import token_logprobs, use_packed_attention
from harness_trainer.trainer.step.packing import collate
from harness_trainer.trainer.step.rows import Row
from harness_trainer.trainer.step.shared_prefix import shared_prefix_logprobs


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


def grpo_group(members: int = 4) -> list[Row]:
    """A GRPO group's rows: one 200-id prompt, then each member's own turns (two open alike for 40 ids,
    two are the same sample), sampled tokens trained after the prompt; plus a row of another task."""
    rng = random.Random(1)
    prompt = [rng.randrange(1, 4000) for _ in range(200)]
    opening = [rng.randrange(1, 4000) for _ in range(40)]
    rests = [opening + [rng.randrange(1, 4000) for _ in range(30)], [*opening, rng.randrange(1, 4000)]]
    rests += [[rng.randrange(1, 4000) for _ in range(rng.randint(5, 60))] for _ in range(members - 3)]
    rests.append(list(rests[-1]))
    rows = [row(m, prompt + rest, tail_targets(200 + len(rest), len(rest))) for m, rest in enumerate(rests)]
    other = [rng.randrange(1, 4000) for _ in range(90)]
    return [*rows, row(members, other, tail_targets(90, 30))]


def packed_and_shared(packed_model, shared_model, rows, *, temperature=0.8):
    """Both paths' target logprobs and entropies over ``rows`` collated, after each one's backward of
    the same weighted loss."""
    from harness_trainer.trainer.step.shared_prefix import micro_batch_logprobs

    rollouts = sorted({r.rollout for r in rows})
    weights = {index: 1.0 / (index + 2) for index in rollouts}
    batch = collate(rows, dict.fromkeys(rollouts, 1.0), weights)
    packed, packed_entropy = token_logprobs(packed_model, batch, temperature, targets_only=True)
    (packed * batch.token_weights).sum().backward()
    shared, shared_entropy, forwarded = micro_batch_logprobs(shared_model, batch, rows, temperature)
    (shared * batch.token_weights).sum().backward()
    return batch, (packed, packed_entropy), (shared, shared_entropy), forwarded


def assert_same_gradients(first, second):
    named = dict(second.named_parameters())
    compared = 0
    for name, p in first.named_parameters():
        if p.grad is None:
            assert named[name].grad is None, name
            continue
        compared += 1
        # Float rounding differs (other matmul shapes): compare each gradient against its own size.
        assert float((p.grad - named[name].grad).norm()) <= 1e-4 * float(p.grad.norm()), name
    assert compared


@pytest.mark.parametrize("members", [4, 8])
def test_a_grpo_groups_micro_batch_equals_the_packed_forward_at_its_trees_tokens(tiny_model_dir, members):
    from transformers import AutoModelForCausalLM

    from harness_trainer.trainer.step.prefix_tree import forwarded_tokens, prefix_tree

    rows = grpo_group(members)
    packed_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    use_packed_attention(packed_model)
    shared_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    use_packed_attention(shared_model)  # as the trainer loads it: the cached forwards take sdpa's mask

    batch, (packed, packed_entropy), (shared, shared_entropy), forwarded = packed_and_shared(
        packed_model, shared_model, rows
    )
    assert torch.allclose(shared, packed, atol=1e-5) and bool((shared[~batch.targets] == 0).all())
    assert torch.allclose(shared_entropy, packed_entropy, atol=1e-4)
    assert_same_gradients(packed_model, shared_model)
    assert forwarded == forwarded_tokens(prefix_tree([r.input_ids for r in rows])) < batch.n_tokens
    assert forwarded <= batch.n_tokens - (members - 1) * 200  # the prompt once, not once per member


def test_a_lora_policy_gets_the_packed_forwards_logprobs_and_adapter_gradients(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rows = grpo_group(4)
    models = []
    for _ in range(2):
        torch.manual_seed(0)  # the same adapter initialisation in both
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        use_packed_attention(base)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        models.append(get_peft_model(base, config))
    _, (packed, _), (shared, _), _ = packed_and_shared(*models, rows)
    assert torch.allclose(shared, packed, atol=1e-5)
    assert_same_gradients(*models)
    assert all("lora_" in n for n, p in models[1].named_parameters() if p.grad is not None)


def test_gradient_checkpointing_is_refused_with_the_knob_that_turns_it_off(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with pytest.raises(ValueError, match=r"gradient checkpointing drops.*shared_prefix=False"):
        shared_prefix_logprobs(model, grpo_group(4))
