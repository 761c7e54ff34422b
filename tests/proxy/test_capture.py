"""Reading the engine's reply: prompt ids cut out as text, pairing checks, and the journal's id validation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import orjson
import pytest

from capture_proxy.capture import capture
from capture_proxy.journal import Journal, read_records
from capture_proxy.records import MODEL, CallRecord
from capture_proxy.reply import split_prompt_ids
from tests.proxy.conftest import Stack


@pytest.mark.parametrize(
    "reply",
    [
        {"id": "a", "prompt_token_ids": [1, 2, 3], "choices": []},
        {"id": "a", "choices": [], "prompt_token_ids": [1, 2, 3]},
        {"prompt_token_ids": [1, 2, 3]},
        {
            "id": "a",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"message": {"content": '"prompt_token_ids":[9]'}}],
        },
    ],
)
def test_prompt_ids_are_cut_out_of_a_compact_reply_and_the_rest_still_parses(reply: dict) -> None:
    text, rest = split_prompt_ids(orjson.dumps(reply))
    assert text == b"1,2,3"
    assert orjson.loads(rest) == {k: v for k, v in reply.items() if k != "prompt_token_ids"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"id":"a","choices":[]}',
        b'{"prompt_token_ids":null}',
        json.dumps({"prompt_token_ids": [1, 2]}, indent=1).encode(),
        b'{"prompt_token_ids":[1],"x":{"prompt_token_ids":[2]}}',
    ],
)
def test_anything_but_one_compact_top_level_array_is_left_to_the_full_parse(raw: bytes) -> None:
    assert split_prompt_ids(raw) == (None, raw)


def reply_with(completion: list, tokens: list, logprobs: list) -> dict:
    content = [{"token": t, "logprob": lp} for t, lp in zip(tokens, logprobs, strict=True)]
    return {"choices": [{"token_ids": completion, "logprobs": {"content": content}}]}


def test_a_well_paired_reply_has_no_finding() -> None:
    captured = capture(reply_with([5, 6], ["token_id:5", "token_id:6"], [-0.1, -2.0]), b"1,2")
    assert captured.finding is None and captured.logprobs == [-0.1, -2.0] and captured.prompt_text == b"1,2"


@pytest.mark.parametrize(
    ("completion", "tokens", "logprobs", "code"),
    [
        ([5, 6], ["token_id:5"], [-0.1], "logprob_count_mismatch"),
        ([5, 6], ["token_id:5", "token_id:7"], [-0.1, -0.1], "token_mismatch"),
        ([5, 6], ["5", "6"], [-0.1, -0.1], "token_mismatch"),
        ([5], ["token_id:5"], [0.5], "bad_logprobs"),
        ([5], ["token_id:5"], [float("nan")], "bad_logprobs"),
        ([5], ["token_id:5"], [float("-inf")], "bad_logprobs"),
        ([-1], ["token_id:-1"], [-0.1], "bad_token_ids"),
        ([1.5], ["token_id:1.5"], [-0.1], "bad_token_ids"),
    ],
)
def test_a_reply_failing_a_check_gets_a_finding(
    completion: list, tokens: list, logprobs: list, code: str
) -> None:
    captured = capture(reply_with(completion, tokens, logprobs), b"1")
    assert captured.finding is not None and captured.finding.code == code
    if captured.logprobs is not None:
        assert captured.logprobs == [0.0] * len(completion)  # context only: placeholders, never trained


def test_a_reply_without_ids_says_how_to_serve_the_engine() -> None:
    captured = capture({"choices": [{"message": {}}]})
    assert captured.finding is not None and captured.finding.code == "no_token_ids"
    assert "--return-tokens-as-token-ids" in captured.finding.detail


@pytest.mark.parametrize(
    "prompt_text", [b"", b"1,,2", b"1,-2", b"1,2.5", b"01,2", b"1,4294967296", b"1,true"]
)
def test_invalid_prompt_ids_are_journaled_as_a_finding_not_as_ids(tmp_path: Path, prompt_text: bytes) -> None:
    journal = Journal(tmp_path)
    journal.open()
    record = CallRecord(
        seq=0,
        call_id="call-00000",
        kind=MODEL,
        dialect="chat",
        has_tools=False,
        started_at=0,
        finished_at=0,
        upstream_request={"messages": []},
        agent_params={},
        sampling={},
        response={},
        prompt_text=prompt_text,
        completion_token_ids=[1],
        logprobs=[-0.1],
    )
    asyncio.run(journal.append(record))
    (back,) = read_records(journal.path)
    assert not back.has_ids and back.finding is not None and back.finding.code == "bad_token_ids"


def test_a_pretty_printed_engine_reply_takes_the_slow_path_and_captures_the_same(stack: Stack) -> None:
    session = stack.new_session()
    headers = {"Authorization": f"Bearer {session['session_id']}"}
    body = {"messages": [{"role": "user", "content": "SAY:same"}]}
    httpx.post(stack.engine_url + "/_faults", json={"queue": [{"mode": "spaced"}]}).raise_for_status()
    for _ in range(2):
        assert (
            httpx.post(session["base_url"] + "/chat/completions", headers=headers, json=body).status_code
            == 200
        )
    spaced, compact = stack.calls(session["session_id"])
    assert spaced["prompt_token_ids"] == compact["prompt_token_ids"] and spaced["finding"] is None
