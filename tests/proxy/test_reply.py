"""Reading the engine's raw reply: what is cut out of the bytes before parsing equals what a full parse
reads, and anything unusual falls back to the full parse."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.capture import capture
from capture_proxy.reply import EngineReply, read_reply


def entry(token_id: int, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One entry as vLLM writes it (``bytes`` and ``top_logprobs`` included)."""
    token = f"token_id:{token_id}"
    return {"token": token, "logprob": logprob, "bytes": [116, 111], "top_logprobs": top or []}


def vllm_reply(ids: list[int], logprobs: list[float], content: str = "ok", **choice: Any) -> dict[str, Any]:
    entries = [entry(i, lp) for i, lp in zip(ids, logprobs, strict=True)]
    first = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "tool_calls": []},
        "logprobs": {"content": entries},
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": ids,
        **choice,
    }
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [first],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)},
        "prompt_logprobs": None,
        "prompt_token_ids": [1, 2, 3],
    }


def same_capture(read: EngineReply, whole: dict[str, Any]) -> None:
    """The cut reply captures exactly what the whole reply does, and its body is the whole minus the cuts."""
    fast, slow = capture(read.body, read.prompt_text, read.logprobs), capture(whole)
    assert (fast.prompt_text, fast.completion_token_ids, fast.logprobs) == (
        slow.prompt_text,
        slow.completion_token_ids,
        slow.logprobs,
    )
    assert (fast.finding is None) == (slow.finding is None)
    body = {k: v for k, v in whole.items() if k != "prompt_token_ids" or read.prompt_text is None}
    if read.logprobs is not None:
        body["choices"] = [{k: v for k, v in whole["choices"][0].items() if k != "logprobs"}]
    assert read.body == body


def test_a_vllm_reply_is_read_with_its_logprobs_and_prompt_ids_cut_out() -> None:
    whole = vllm_reply([5, 6, 7], [-0.5, -1.25, -3.0])
    read = read_reply(orjson.dumps(whole))
    assert read.prompt_text == b"1,2,3"
    assert read.logprobs is not None and [(e.token, e.logprob) for e in read.logprobs] == [
        ("token_id:5", -0.5),
        ("token_id:6", -1.25),
        ("token_id:7", -3.0),
    ]
    assert "logprobs" not in read.body["choices"][0] and "prompt_token_ids" not in read.body
    same_capture(read, whole)


@pytest.mark.parametrize(
    "content",
    [
        '"logprobs":{"content":[}]}',
        '{"logprobs":{"content":[{"token":"token_id:9","logprob":-1}]}}',
        '"prompt_token_ids":[9]',
        "}]}",
    ],
)
def test_the_keys_inside_a_string_are_never_cut(content: str) -> None:
    whole = vllm_reply([5], [-0.5], content=content)
    read = read_reply(orjson.dumps(whole))
    assert read.body["choices"][0]["message"]["content"] == content
    same_capture(read, whole)


@pytest.mark.parametrize("where", [0, -1])
def test_non_empty_top_logprobs_are_cut_and_read_the_same(where: int) -> None:
    # An entry with top_logprobs holds "}]}" itself: the end of the logprobs is the last one before the ids.
    whole = vllm_reply([5, 6], [-0.5, -1.0])
    whole["choices"][0]["logprobs"]["content"][where]["top_logprobs"] = [entry(5, -0.5)]
    read = read_reply(orjson.dumps(whole))
    assert read.logprobs is not None and "logprobs" not in read.body["choices"][0]
    same_capture(read, whole)


@pytest.mark.parametrize("stop", ["}]}", '"}]}', "x}]},"])
def test_a_closing_in_a_string_after_the_logprobs_falls_back_to_the_full_parse(stop: str) -> None:
    whole = vllm_reply([5, 6], [-0.5, -1.0], stop_reason=stop)
    read = read_reply(orjson.dumps(whole))
    assert read.body["choices"][0]["stop_reason"] == stop
    same_capture(read, whole)


def test_prompt_ids_before_the_choices_are_cut_too() -> None:
    whole = vllm_reply([5, 6], [-0.5, -1.0])
    whole = {"prompt_token_ids": whole.pop("prompt_token_ids"), **whole}
    read = read_reply(orjson.dumps(whole))
    assert read.prompt_text == b"1,2,3" and read.logprobs is not None
    same_capture(read, whole)


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "Infinity"])
def test_non_finite_logprobs_are_read_by_the_full_parse_and_refused_by_the_check(value: str) -> None:
    raw = orjson.dumps(vllm_reply([5, 6], [-0.5, -1.5])).replace(b"-1.5", value.encode())
    read = read_reply(raw)
    assert read.logprobs is None
    captured = capture(read.body, read.prompt_text, read.logprobs)
    assert captured.finding is not None and captured.finding.code == "bad_logprobs"


@pytest.mark.parametrize(
    "raw",
    [
        orjson.dumps(vllm_reply([], [])),  # empty content: the cut would not be one JSON value
        json.dumps(vllm_reply([5], [-0.5]), indent=1).encode(),  # spaced: nothing matches
        orjson.dumps({**vllm_reply([5], [-0.5]), "logprobs": {"content": [entry(1, -1.0)]}}),  # twice
    ],
)
def test_unusual_replies_are_parsed_whole_and_read_the_same(raw: bytes) -> None:
    read = read_reply(raw)
    whole = json.loads(raw)
    fast, slow = capture(read.body, read.prompt_text, read.logprobs), capture(whole)
    assert (fast.completion_token_ids, fast.logprobs, fast.finding) == (
        slow.completion_token_ids,
        slow.logprobs,
        slow.finding,
    )


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"choices": [}'])
def test_a_reply_that_is_not_a_json_object_says_so(raw: bytes) -> None:
    with pytest.raises(ValueError, match="the engine's reply is not"):
        read_reply(raw)


# JSON text is UTF-8: lone surrogates cannot reach the proxy from an engine, so they are not generated.
texts = st.text(alphabet=st.sampled_from('ab"{}[]:,\\ \n') | st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**31), max_size=6),
    content=texts,
    arguments=texts,
    data=st.data(),
)
def test_any_reply_reads_the_same_cut_or_whole(
    ids: list[int], content: str, arguments: str, data: Any
) -> None:
    logprobs = data.draw(st.lists(st.floats(-50, 0), min_size=len(ids), max_size=len(ids)))
    whole = vllm_reply(ids, logprobs, content=content)
    whole["choices"][0]["message"]["tool_calls"] = [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    ]
    read = read_reply(orjson.dumps(whole))
    assert (read.logprobs is not None) == bool(ids)  # the fast path, whenever there are entries
    same_capture(read, whole)
