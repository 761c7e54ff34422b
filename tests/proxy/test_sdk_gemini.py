"""Google's official ``google-genai`` SDK against the capture proxy and the fake engine, over real HTTP.

The session id is the API key (the SDK sends it as ``x-goog-api-key``); ``base_url`` is the proxy's root
(the SDK adds ``/v1beta/models/{model}:generateContent``, or ``:streamGenerateContent?alt=sse``). The
fake engine answers ``SAY:<text>`` with that text and ``CALL:<name>:<json>`` with a tool call (see
``tests/proxy/fake_engine.py``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from tests.proxy.conftest import Stack

SHELL = types.Tool(
    function_declarations=[
        types.FunctionDeclaration(
            name="shell",
            description="Run a command.",
            parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}}},
        )
    ]
)
# The SDK would otherwise call Python functions itself (automatic function calling); these tools are
# declarations only, and the tests run the loop.
MANUAL = types.AutomaticFunctionCallingConfig(disable=True)


def _client(session: dict[str, Any], base_url: str | None = None) -> genai.Client:
    options = types.HttpOptions(base_url=base_url or session["root_url"], timeout=30_000)
    return genai.Client(api_key=session["session_id"], http_options=options)


def _ask(client: genai.Client, stream: bool, contents: Any, **config: Any) -> types.GenerateContentResponse:
    """One call; a stream's chunks are folded into one response (text joined, parts in order)."""
    request: dict[str, Any] = {
        "model": "gemini-x",
        "contents": contents,
        "config": types.GenerateContentConfig(automatic_function_calling=MANUAL, **config),
    }
    if not stream:
        return client.models.generate_content(**request)
    chunks = list(client.models.generate_content_stream(**request))
    parts: list[types.Part] = []
    for chunk in chunks:
        for part in chunk.candidates[0].content.parts:  # type: ignore[index,union-attr]
            if part.text is not None and parts and parts[-1].text is not None:
                parts[-1] = types.Part(text=parts[-1].text + part.text)
            else:
                parts.append(part)
    last = chunks[-1]
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])  # type: ignore[index]
    candidate = types.Candidate(
        content=types.Content(role="model", parts=parts),
        finish_reason=last.candidates[0].finish_reason,  # type: ignore[index]
    )
    return types.GenerateContentResponse(
        candidates=[candidate],
        usage_metadata=last.usage_metadata,
        model_version=last.model_version,
        response_id=last.response_id,
    )


def _user(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_is_answered_and_journaled_once(stack: Stack, stream: bool) -> None:
    session = stack.new_session()
    response = _ask(_client(session), stream, "SAY:hello there", system_instruction="Be brief.")
    assert response.text == "hello there" and response.model_version == "gemini-x"
    assert response.candidates[0].finish_reason == types.FinishReason.STOP  # type: ignore[index]
    usage = response.usage_metadata
    assert usage is not None and usage.prompt_token_count and usage.candidates_token_count
    assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count
    [record] = stack.calls(session["session_id"])
    assert record["dialect"] == "gemini" and record["kind"] == "model" and not record["has_tools"]
    assert record["upstream_request"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "SAY:hello there"},
    ]


def test_the_raw_event_stream_is_data_frames_ending_with_finish_reason_and_usage(stack: Stack) -> None:
    session = stack.new_session()
    url = f"{stack.url}/v1beta/models/gemini-x:streamGenerateContent?alt=sse"
    body = {"contents": [{"role": "user", "parts": [{"text": "SAY:" + "word " * 40}]}]}
    response = httpx.post(url, json=body, headers={"x-goog-api-key": session["session_id"]}, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-1] == "" and all(frame.startswith("data: {") for frame in frames[:-1])
    chunks = [json.loads(frame.removeprefix("data: ")) for frame in frames[:-1]]
    assert len(chunks) > 1 and "".join(c["candidates"][0]["content"]["parts"][0]["text"] for c in chunks) == (
        "word " * 40
    )
    assert [("finishReason" in c["candidates"][0], "usageMetadata" in c) for c in chunks] == [
        (False, False)
    ] * (len(chunks) - 1) + [(True, True)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trips_with_the_engines_id(stack: Stack, stream: bool) -> None:
    session = stack.new_session()
    client = _client(session)
    history = [_user('list the files CALL:shell:{"command": "ls"}')]
    first = _ask(client, stream, history, tools=[SHELL])
    [call] = first.function_calls or []
    assert call.name == "shell" and call.args == {"command": "ls"}
    engine_id = stack.calls(session["session_id"])[0]["response"]["choices"][0]["message"]["tool_calls"][0][
        "id"
    ]
    assert call.id == engine_id

    result = types.Part.from_function_response(name="shell", response={"output": "a.txt"})
    result.function_response.id = call.id  # type: ignore[union-attr]  # as gemini-cli sends it back
    answered = first.candidates[0].content  # type: ignore[index]
    assert answered is not None
    history += [answered, types.Content(role="user", parts=[result])]
    second = _ask(client, stream, history, tools=[SHELL])
    assert second.text == 'ok: {"output": "a.txt"}' and not second.function_calls

    records = stack.calls(session["session_id"])
    assert [record["has_tools"] for record in records] == [True, True]
    assert records[1]["upstream_request"]["messages"][-2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": engine_id,
                    "type": "function",
                    "function": {"name": "shell", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": engine_id, "content": '{"output": "a.txt"}'},
    ]
    turns = stack.trace(session["session_id"])["turns"]
    assert [turn["metadata"]["parent"] for turn in turns] == [None, turns[0]["node_id"]]


def test_a_history_without_call_ids_is_matched_by_name_and_still_extends_the_first_call(stack: Stack) -> None:
    session = stack.new_session()
    client = _client(session)
    history = [_user('CALL:shell:{"command": "ls"}')]
    first = _ask(client, False, history, tools=[SHELL])
    [call] = first.function_calls or []
    # The SDK's own helpers, as a client that keeps no ids builds its history: no id on either side.
    bare_call = types.Part.from_function_call(name=call.name or "", args=call.args or {})
    bare_result = types.Part.from_function_response(name="shell", response={"output": "a.txt"})
    history += [
        types.Content(role="model", parts=[bare_call]),
        types.Content(role="user", parts=[bare_result]),
    ]
    assert _ask(client, False, history, tools=[SHELL]).text == 'ok: {"output": "a.txt"}'

    messages = stack.calls(session["session_id"])[1]["upstream_request"]["messages"]
    assert messages[-2]["tool_calls"][0]["id"] == "call_1_0"
    assert messages[-1] == {"role": "tool", "tool_call_id": "call_1_0", "content": '{"output": "a.txt"}'}
    turns = stack.trace(session["session_id"])["turns"]
    assert [turn["metadata"]["parent"] for turn in turns] == [None, turns[0]["node_id"]]


def test_generation_config_is_recorded_as_sent_and_the_output_cap_is_reported(stack: Stack) -> None:
    session = stack.new_session()
    client = _client(session)
    capped = _ask(client, True, "SAY:a long answer", max_output_tokens=4, temperature=0.2, top_k=5, seed=7)
    assert capped.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS  # type: ignore[index]
    stopped = _ask(client, False, "SAY:one END two", stop_sequences=["END"])
    assert stopped.text == "one "
    assert stopped.candidates[0].finish_reason == types.FinishReason.STOP  # type: ignore[index]
    first, second = stack.calls(session["session_id"])
    assert first["agent_params"] == {
        "generationConfig": {"temperature": 0.2, "topK": 5.0, "maxOutputTokens": 4, "seed": 7}
    }
    assert first["upstream_request"]["max_tokens"] == 4 and first["upstream_request"]["temperature"] == 1.0
    assert second["upstream_request"]["stop"] == ["END"]


@pytest.mark.parametrize(
    "config",
    [
        {
            "tools": [SHELL],
            "tool_config": types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY")),
        },
        {
            "tools": [SHELL],
            "tool_config": types.ToolConfig(
                function_calling_config=types.FunctionCallingConfig(
                    mode="AUTO", allowed_function_names=["shell"]
                )
            ),
        },
        {"response_mime_type": "application/json"},
        {"response_mime_type": "application/json", "response_schema": {"type": "OBJECT"}},
        {"response_json_schema": {"type": "object"}},
        {"candidate_count": 2},
        {"tools": [types.Tool(google_search=types.GoogleSearch())]},
    ],
)
def test_a_refused_request_raises_the_sdks_client_error_and_spends_nothing(stack: Stack, config: Any) -> None:
    session = stack.new_session(max_model_calls=1)
    client = _client(session)
    with pytest.raises(errors.ClientError) as caught:
        _ask(client, False, "SAY:hi", **config)
    assert (caught.value.code, caught.value.status) == (400, "INVALID_ARGUMENT")
    assert stack.calls(session["session_id"]) == [] and stack.engine.requests == []
    assert _ask(client, False, "SAY:still here").text == "still here"


def test_an_image_is_refused_as_unsupported(stack: Stack) -> None:
    client = _client(stack.new_session())
    image = types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")
    with pytest.raises(errors.ClientError) as caught:
        _ask(client, False, [types.Content(role="user", parts=[types.Part(text="what is it?"), image])])
    assert caught.value.code == 400 and "inlineData" in (caught.value.message or "")


def test_count_tokens_is_answered_without_a_journal_record(stack: Stack) -> None:
    session = stack.new_session()
    client = _client(session)  # held: a genai.Client closes its HTTP client when collected
    counted = client.models.count_tokens(model="gemini-x", contents="how big is this?")
    assert counted.total_tokens is not None and counted.total_tokens > 1
    assert stack.calls(session["session_id"]) == [] and stack.engine.requests == []


def test_the_key_also_works_as_a_query_parameter_and_as_the_path_prefix(stack: Stack) -> None:
    session = stack.new_session()
    body = {"contents": [{"role": "user", "parts": [{"text": "SAY:by query"}]}]}
    url = f"{stack.url}/v1beta/models/gemini-x:generateContent"
    answer = httpx.post(url, params={"key": session["session_id"]}, json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["candidates"][0]["content"]["parts"] == [{"text": "by query"}]
    prefixed = genai.Client(
        api_key="not-the-session",
        http_options=types.HttpOptions(base_url=f"{stack.url}/s/{session['session_id']}", timeout=30_000),
    )
    assert _ask(prefixed, True, "SAY:by prefix").text == "by prefix"
    assert len(stack.calls(session["session_id"])) == 2


@pytest.mark.parametrize("version", ["v1beta", "v1"])
def test_both_api_versions_are_served_whichever_the_sdk_defaults_to(stack: Stack, version: str) -> None:
    # gemini-cli and google-genai 2.x send v1beta; google-genai 3.x defaults to v1.
    session = stack.new_session()
    options = types.HttpOptions(base_url=session["root_url"], api_version=version, timeout=30_000)
    client = genai.Client(api_key=session["session_id"], http_options=options)
    for stream in (False, True):
        assert _ask(client, stream, f"SAY:{version}").text == version
    [first, _] = stack.calls(session["session_id"])
    assert first["dialect"] == "gemini"
    with pytest.raises(errors.ClientError) as refused:  # errors in Google's shape under either version
        _ask(client, False, "SAY:x", response_mime_type="application/json")
    assert refused.value.code == 400 and refused.value.status == "INVALID_ARGUMENT"


def test_an_unknown_api_key_raises_a_401_client_error(stack: Stack) -> None:
    client = _client({"session_id": "no-such-session", "root_url": stack.url})
    with pytest.raises(errors.ClientError) as caught:
        _ask(client, False, "hi")
    assert (caught.value.code, caught.value.status) == (401, "UNAUTHENTICATED")


def test_a_stream_without_alt_sse_is_refused_in_googles_error_shape(stack: Stack) -> None:
    session = stack.new_session()
    url = f"{stack.url}/v1beta/models/gemini-x:streamGenerateContent"
    body = {"contents": [{"role": "user", "parts": [{"text": "SAY:hi"}]}]}
    answer = httpx.post(url, json=body, headers={"x-goog-api-key": session["session_id"]}, timeout=30)
    assert answer.status_code == 400
    assert (
        answer.json()["error"]["status"] == "INVALID_ARGUMENT"
        and "alt=sse" in answer.json()["error"]["message"]
    )
    assert stack.calls(session["session_id"]) == []


def test_a_spent_budget_answers_a_final_message_in_both_modes(stack: Stack) -> None:
    session = stack.new_session(max_model_calls=1)
    client = _client(session)
    _ask(client, False, "SAY:first")
    for stream in (False, True):
        final = _ask(client, stream, "SAY:second", tools=[SHELL])
        assert "budget" in (final.text or "").lower() and not final.function_calls


def test_an_engine_failure_is_a_server_error(stack: Stack) -> None:
    session = stack.new_session()
    stack.engine.faults = [{"mode": "status", "status": 500}] * 3
    with pytest.raises(errors.ServerError) as caught:
        _ask(_client(session), False, "SAY:never")
    assert (caught.value.code, caught.value.status) == (502, "UNAVAILABLE")


def slow_session(stack: Stack, engine_delay_s: float) -> dict[str, Any]:
    """A new session on a proxy restarted with a 0.1 s keepalive, its engine holding the next reply."""
    stack.stop_proxy()
    stack.config_overrides["keepalive_s"] = 0.1
    stack.start_proxy()
    session = stack.new_session()
    httpx.post(stack.engine_url + "/_faults", json={"queue": [{"mode": "delay", "seconds": engine_delay_s}]})
    return session


def test_a_stream_slower_than_the_keepalive_interval_reaches_the_sdk_whole(stack: Stack) -> None:
    # Other dialects get SSE keepalive comments here, which Google's clients cannot parse.
    session = slow_session(stack, engine_delay_s=0.8)
    reply = _ask(_client(session), True, "SAY:worth the wait")
    assert reply.text == "worth the wait"
    assert len(stack.calls(session["session_id"])) == 1


def test_an_engine_failure_after_a_slow_streamed_call_is_the_sdks_server_error(stack: Stack) -> None:
    session = slow_session(stack, engine_delay_s=0.0)
    stack.engine.faults = [{"mode": "status", "status": 500}] * 3  # retried with backoff: 1.5 s in all
    with pytest.raises(errors.ServerError) as caught:
        _ask(_client(session), True, "SAY:never")
    assert (caught.value.code, caught.value.status) == (502, "UNAVAILABLE")
