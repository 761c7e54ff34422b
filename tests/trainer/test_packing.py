"""Packing rows into micro-batches, and per-token logprobs on packed batches matching one forward per row."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness_trainer.trainer.step.logprobs import (
    PACKED_ATTENTION,
    token_logprobs,
    token_logprobs_padded,
    use_packed_attention,
)
from harness_trainer.trainer.step.packing import collate, collate_padded, plan_micro_batches
from harness_trainer.trainer.step.rows import Row

VOCAB = 4096


def make_row(length: int, rollout: int = 0, seed: int = 0, prompt: int | None = None) -> Row:
    """A row whose second half (after ``prompt`` tokens) is trained, with made-up behaviour logprobs."""
    rng = random.Random(seed)
    prompt = length // 2 if prompt is None else prompt
    targets = [0] * prompt + [1] * (length - prompt)
    return Row(
        rollout=rollout,
        input_ids=[rng.randrange(VOCAB) for _ in range(length)],
        targets=targets,
        behaviour_logps=[-rng.uniform(0.1, 5.0) if bit else 0.0 for bit in targets],
    )


def row_logprobs(model: torch.nn.Module, row: Row, temperature: float) -> torch.Tensor:
    """The reference: one forward of the row alone, logprob of each token from the position before it."""
    ids = torch.tensor([row.input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
    logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), logps])


@pytest.fixture(scope="module", params=["sdpa", "eager", PACKED_ATTENTION])
def model(request: pytest.FixtureRequest, tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny model under each attention implementation that packed batches are meant to work with."""
    packed = request.param == PACKED_ATTENTION
    loaded = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa" if packed else request.param
    )
    if packed:
        use_packed_attention(loaded)
        assert loaded.config._attn_implementation == PACKED_ATTENTION
    return loaded.eval()


LENGTHS = [37, 5, 120, 2, 64]
ROWS = [make_row(n, rollout=i % 2, seed=i) for i, n in enumerate(LENGTHS)]
ADVANTAGES = {0: 1.0, 1: -0.5}
WEIGHTS = {0: 0.25, 1: 0.125}


def test_the_plan_is_the_same_for_the_same_rows() -> None:
    rows = [make_row(n, seed=i) for i, n in enumerate([30, 10, 30, 7, 50, 10, 22, 30])]

    first = plan_micro_batches(rows, 64)
    second = plan_micro_batches(list(rows), 64)

    assert [[id(r) for r in batch] for batch in first] == [[id(r) for r in batch] for batch in second]
    # Equal lengths keep their input order: the first 30-token row is placed before the second.
    flat = [id(r) for batch in first for r in batch]
    assert flat.index(id(rows[0])) < flat.index(id(rows[2])) < flat.index(id(rows[7]))


def test_the_plan_keeps_every_row_once_within_the_budget() -> None:
    rng = random.Random(3)
    rows = [make_row(rng.randint(2, 300), seed=i) for i in range(60)]

    plan = plan_micro_batches(rows, 512)

    assert sorted(id(r) for batch in plan for r in batch) == sorted(id(r) for r in rows)
    assert all(sum(len(r.input_ids) for r in batch) <= 512 for batch in plan)
    # First-fit-decreasing packs tightly: no two micro-batches would fit into one.
    sizes = sorted(sum(len(r.input_ids) for r in batch) for batch in plan)
    assert sizes[0] + sizes[1] > 512


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    long, short = make_row(100, seed=1), make_row(10, seed=2)

    plan = plan_micro_batches([short, long], 64)

    assert plan == [[long], [short]]


def test_a_budget_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches(ROWS, 0)


def test_collate_concatenates_rows_and_restarts_position_ids_at_each_row() -> None:
    batch = collate(ROWS[:3], ADVANTAGES, WEIGHTS)

    assert batch.input_ids.shape == batch.position_ids.shape == (1, 37 + 5 + 120)
    assert batch.row_lengths == [37, 5, 120] and batch.n_tokens == 162
    assert batch.position_ids[0].tolist() == [*range(37), *range(5), *range(120)]
    assert batch.input_ids[0].tolist() == ROWS[0].input_ids + ROWS[1].input_ids + ROWS[2].input_ids
    assert batch.n_targets == sum(r.n_targets for r in ROWS[:3])
    assert batch.rollouts.tolist() == [0] * 37 + [1] * 5 + [0] * 120
    assert batch.advantages[37:42].tolist() == [-0.5] * 5
    # Weights only at targets: the row's prompt half weighs nothing.
    assert batch.token_weights[:18].tolist() == [0.0] * 18
    assert batch.token_weights[18:37].tolist() == [0.25] * 19
    behaviour, targets = batch.behaviour_logps, batch.targets
    assert behaviour[targets].lt(0).all() and behaviour[~targets].eq(0).all()
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.row_lengths == batch.row_lengths


def test_collate_refuses_rows_it_cannot_weigh_or_train() -> None:
    with pytest.raises(ValueError, match=r"rollout_weights has no entry for rollout\(s\) \[1\]"):
        collate(ROWS[:2], ADVANTAGES, {0: 1.0})
    with pytest.raises(ValueError, match="first token"):
        collate([make_row(4, prompt=0)], ADVANTAGES, WEIGHTS)
    with pytest.raises(ValueError, match="empty"):
        collate([], ADVANTAGES, WEIGHTS)


def test_collate_padded_right_pads_every_field() -> None:
    batch = collate_padded(ROWS[:2], ADVANTAGES, WEIGHTS, pad_id=7)

    assert batch.input_ids.shape == batch.targets.shape == (2, 37)
    assert batch.input_ids[1, 5:].eq(7).all() and batch.attention_mask[1].tolist() == [1] * 5 + [0] * 32
    assert not batch.targets[1, 5:].any() and batch.token_weights[1, 5:].eq(0).all()
    assert batch.n_tokens == 42 and batch.n_targets == ROWS[0].n_targets + ROWS[1].n_targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_equal_one_forward_per_row(model: torch.nn.Module, temperature: float) -> None:
    batch = collate(ROWS, ADVANTAGES, WEIGHTS)

    with torch.no_grad():
        logps, entropy = token_logprobs(model, batch, temperature)

    expected = torch.cat([row_logprobs(model, row, temperature) for row in ROWS])
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    assert entropy is not None and entropy.shape == logps.shape
    assert entropy[batch.position_ids[0] == 0].eq(0).all() and entropy[batch.position_ids[0] > 0].gt(0).all()


def test_a_changed_token_in_one_row_leaves_the_other_rows_unchanged(model: torch.nn.Module) -> None:
    changed = Row(0, [*ROWS[0].input_ids], ROWS[0].targets, ROWS[0].behaviour_logps)
    changed.input_ids[3] = (changed.input_ids[3] + 1) % VOCAB

    with torch.no_grad():
        before, _ = token_logprobs(model, collate(ROWS[:3], ADVANTAGES, WEIGHTS), 1.0, with_entropy=False)
        after, _ = token_logprobs(model, collate([changed, *ROWS[1:3]], ADVANTAGES, WEIGHTS), 1.0)

    assert not torch.allclose(before[:37], after[:37])
    assert torch.equal(before[37:], after[37:])


def test_targets_only_gives_the_same_logprobs_at_targets_and_zero_elsewhere(model: torch.nn.Module) -> None:
    batch = collate(ROWS, ADVANTAGES, WEIGHTS)

    with torch.no_grad():
        full, full_entropy = token_logprobs(model, batch, 1.0)
        only, only_entropy = token_logprobs(model, batch, 1.0, targets_only=True)

    assert full_entropy is not None and only_entropy is not None
    torch.testing.assert_close(only[batch.targets], full[batch.targets], atol=1e-5, rtol=0)
    torch.testing.assert_close(only_entropy[batch.targets], full_entropy[batch.targets], atol=1e-5, rtol=0)
    assert only[~batch.targets].eq(0).all() and only_entropy[~batch.targets].eq(0).all()


def test_padded_logprobs_equal_packed_ones_on_real_tokens(model: torch.nn.Module) -> None:
    packed, padded = collate(ROWS, ADVANTAGES, WEIGHTS), collate_padded(ROWS, ADVANTAGES, WEIGHTS)

    with torch.no_grad():
        packed_logps, _ = token_logprobs(model, packed, 1.0)
        padded_logps, padded_entropy = token_logprobs_padded(model, padded, 1.0)

    real = padded.attention_mask.bool()
    torch.testing.assert_close(padded_logps[real], packed_logps, atol=1e-5, rtol=0)
    assert padded_logps[~real].eq(0).all()
    assert padded_entropy is not None and padded_entropy[~real].eq(0).all()


def test_logprobs_carry_gradients_to_the_model(model: torch.nn.Module) -> None:
    batch = collate(ROWS[:2], ADVANTAGES, WEIGHTS)

    logps, _ = token_logprobs(model, batch, 1.0, targets_only=True)
    logps.sum().backward()

    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_a_temperature_of_zero_is_refused(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, collate(ROWS[:1], ADVANTAGES, WEIGHTS), 0.0)


def load(model_dir: Path, packed: bool) -> torch.nn.Module:
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if packed:
        use_packed_attention(loaded)
    return loaded.eval()


def test_packed_attention_runs_one_causal_sdpa_per_row_and_layer(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(tiny_model_dir, packed=True)
    calls: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(bool(kwargs.get("is_causal")) and kwargs.get("attn_mask") is None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        token_logprobs(model, collate(ROWS, ADVANTAGES, WEIGHTS), 1.0)

    assert calls == [True] * (model.config.num_hidden_layers * len(ROWS))


def test_packed_attention_keeps_rows_apart_in_every_batch_row(tiny_model_dir: Path) -> None:
    # Two packed sequences of 40 tokens, split differently; transformers' sdpa (block mask) is the reference.
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.stack(
        [
            torch.cat([torch.arange(10), torch.arange(30)]),
            torch.cat([torch.arange(25), torch.arange(5), torch.arange(10)]),
        ]
    )

    with torch.no_grad():
        packed = load(tiny_model_dir, packed=True)(input_ids=ids, position_ids=positions, use_cache=False)
        masked = load(tiny_model_dir, packed=False)(input_ids=ids, position_ids=positions, use_cache=False)

    torch.testing.assert_close(packed.logits, masked.logits, atol=1e-5, rtol=0)
