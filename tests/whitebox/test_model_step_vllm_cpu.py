"""The white-box model step against a real vLLM (vllm-cpu): what the dev engine's tests cannot prove, that
vLLM's ``/v1/completions`` takes a token-id prompt with the step's body and answers with the sampled ids and
processed logprobs where the step reads them, and that an episode driven by OpenEnv's own adapter over it
builds a valid, trainable trace of vLLM's ids."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("openenv")
pytest.importorskip("trl")

from transformers import AutoTokenizer

from harness_trainer.trainer.step.rows import build_rows, row_stats
from tests.test_vllm_cpu_parity import model_dir, pytestmark, vllm_url  # noqa: F401 - fixtures and marks
from tests.whitebox.test_model_step import direct_completion, make_step, run_episode


@pytest.fixture(scope="module")
def tokenizer(model_dir: Any) -> Any:  # noqa: F811
    return AutoTokenizer.from_pretrained(model_dir)


def test_a_turn_is_vllms_own_ids_and_processed_logprobs(vllm_url: str, tokenizer: Any) -> None:  # noqa: F811
    messages = [{"role": "user", "content": "Say something."}]
    with make_step(tokenizer, vllm_url, max_completion_tokens=12) as step:
        step.policy_version = 3  # vLLM names no weight version: the trainer's last push is recorded
        result = step(messages, [], {})
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))  # fmt: skip
    assert result.prompt_ids == prompt
    direct = direct_completion(vllm_url, prompt, max_tokens=12)
    # The same seeded sample: vLLM's own ids and logprobs, never re-tokenised text.
    assert result.completion_ids == direct["choices"][0]["token_ids"]
    assert result.logprobs == pytest.approx(direct["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    record = step.records[0]
    assert len(record.completion_ids) == len(record.logprobs) > 0 and all(v <= 0 for v in record.logprobs)
    assert record.weight_version == 3 and record.finish_reason in ("stop", "length")
    assert record.started_at is not None and record.finished_at is not None


def test_an_episode_over_vllm_builds_a_trainable_trace_of_its_ids(vllm_url: str, tokenizer: Any) -> None:  # noqa: F811
    with make_step(tokenizer, vllm_url, max_completion_tokens=24) as step:
        result, _session = run_episode(step, max_turns=3)
        episode = step.trace()
    turns = episode.trace.turns
    assert 1 <= len(turns) <= 3 and len(turns) == len(step.records)
    for turn, record in zip(turns, step.records, strict=True):
        assert turn.completion_token_ids == record.completion_ids and turn.per_token_logps == record.logprobs
    # Every sampled id is trained exactly once, however the template re-rendered history.
    rows = build_rows(episode.trace, vocab_size=len(tokenizer), temperature=1.0, session_id="vllm")
    assert row_stats(episode.trace, rows).trained_tokens == sum(len(t.completion_token_ids) for t in turns)
    assert episode.metrics["whitebox/turns"] == len(turns) and result is not None
