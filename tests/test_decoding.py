"""Pure decoding helpers: processed logprobs, one sampling step, stop strings, incremental detokenizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from harness_trainer.dev_engine.decoding import (
    IncrementalDetokenizer,
    StopMatch,
    find_stop,
    processed_logprobs,
    sample_token,
)

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
MIXED_TEXT = "héllo wörld 漢字 🙂, ça va? Ünïcödé — naïve café… 🎉🚀 done."


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.5])
def test_processed_logprobs_are_log_softmax_of_tempered_logits(temperature: float) -> None:
    expected = torch.log_softmax(LOGITS / temperature, dim=-1)
    assert torch.allclose(processed_logprobs(LOGITS, temperature), expected)


def test_processed_logprobs_are_unscaled_when_greedy() -> None:
    assert torch.allclose(processed_logprobs(LOGITS, 0.0), torch.log_softmax(LOGITS, dim=-1))


def test_processed_logprobs_are_float32_even_from_half_logits() -> None:
    assert processed_logprobs(LOGITS.to(torch.bfloat16), 1.0).dtype == torch.float32


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 3.0])
def test_processed_logprobs_normalise_to_one(temperature: float) -> None:
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(1)) * 8
    total = torch.logsumexp(processed_logprobs(logits, temperature), dim=-1)
    assert torch.allclose(total, torch.zeros(3), atol=1e-5)


def test_sample_token_is_argmax_when_greedy() -> None:
    logprobs = processed_logprobs(LOGITS, 0.0)
    picks = {sample_token(logprobs, 0.0, torch.Generator().manual_seed(seed)) for seed in range(20)}
    assert picks == {3}


def test_sample_token_is_deterministic_for_a_seeded_generator() -> None:
    logprobs = processed_logprobs(torch.zeros(64), 1.0)

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample_token(logprobs, 1.0, generator) for _ in range(32)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_sample_token_draws_from_the_distribution() -> None:
    logprobs = processed_logprobs(torch.tensor([0.0, -100.0, -100.0, 0.0]), 1.0)
    generator = torch.Generator().manual_seed(0)
    picks = {sample_token(logprobs, 1.0, generator) for _ in range(200)}
    assert picks == {0, 3}


def test_find_stop_returns_none_without_a_stop() -> None:
    assert find_stop("nothing to see here", ["STOP", "\n\n"], 0) is None


def test_find_stop_picks_the_earliest_stop_whatever_the_list_order() -> None:
    text = "answer: 42\n\nmore STOP tail"
    assert find_stop(text, ["STOP", "\n\n"], 0) == StopMatch(stop="\n\n", text_end=text.index("\n\n"))


def test_find_stop_ignores_stops_that_ended_before_the_new_text() -> None:
    old = "first STOP then "
    text = old + "more STOP"
    assert find_stop(text, ["STOP"], len(old)) == StopMatch(stop="STOP", text_end=text.rindex("STOP"))
    assert find_stop(old + "more", ["STOP"], len(old)) is None


def test_find_stop_finds_a_stop_completed_across_the_boundary() -> None:
    old = "hello ST"
    text = old + "OP world"
    assert find_stop(text, ["STOP"], len(old)) == StopMatch(stop="STOP", text_end=len("hello "))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_incremental_deltas_add_up_to_the_full_decode(tokenizer) -> None:
    ids = tokenizer(MIXED_TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer.decode)
    deltas = [detok.push(token_id) for token_id in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == MIXED_TEXT
    assert detok.text == MIXED_TEXT


def test_incremental_deltas_never_split_a_character(tokenizer) -> None:
    ids = tokenizer(MIXED_TEXT, add_special_tokens=False)["input_ids"]
    # the tiny vocabulary has no token for these characters: they arrive as several byte tokens
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)
    detok = IncrementalDetokenizer(tokenizer.decode)
    deltas = [detok.push(token_id) for token_id in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + detok.flush() == MIXED_TEXT


def test_flush_returns_an_incomplete_character_as_replacement(tokenizer) -> None:
    ids = tokenizer("ok 🙂", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer.decode)
    pushed = "".join(detok.push(token_id) for token_id in ids[:-1])
    assert "\ufffd" not in pushed
    assert detok.flush().endswith("\ufffd")
