"""The Gemini API dialect, pure: request translation, call ids, refusals, reply and SSE rendering.

Shapes are checked with the official ``google-genai`` SDK's own types (their models forbid unknown
fields), and end to end through the SDK client over an in-memory transport (no proxy, no network).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from capture_proxy.dialects.base import ChatCall, DialectError, Reply, ToolCall
from capture_proxy.dialects.gemini import DIALECT, count_tokens, route_body

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "seed", "stream", "model", "logprobs", "n"}
SHELL = {"name": "shell", "description": "Run.", "parametersJsonSchema": {"type": "object"}}


def _request(contents: Any = None, stream: bool = False, **fields: Any) -> dict[str, Any]:
    body = {"contents": contents if contents is not None else [_user("hi")], **fields}
    return route_body(body, "gemini-x", stream)


def _messages(*contents: dict[str, Any], **fields: Any) -> list[dict[str, Any]]:
    return DIALECT.parse_request(_request(list(contents), **fields)).body["messages"]


def _refusal(body: Any) -> DialectError:
    with pytest.raises(DialectError) as caught:
        DIALECT.parse_request(body)
    assert caught.value.status == 400
    return caught.value


def _user(*texts: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": t} for t in texts]}


def _model(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "model", "parts": list(parts)}


def _fc(name: str = "shell", args: Any = None, call_id: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"name": name, "args": args if args is not None else {}}
    if call_id is not None:
        call["id"] = call_id
    return {"functionCall": call}


def _fr(name: str = "shell", response: Any = None, call_id: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"name": name, "response": response if response is not None else {"output": "x"}}
    if call_id is not None:
        result["id"] = call_id
    return {"functionResponse": result}


def _results(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "parts": list(parts)}


def _tool_call(call_id: str, name: str = "shell", arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reply(**fields: Any) -> Reply:
    values: dict[str, Any] = {
        "id": "chatcmpl-abc123",
        "created": 1_700_000_000,
        "model": "engine-model",
        "content": "Hello there.",
        "tool_calls": [],
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "completion_tokens": 5,
    }
    values.update(fields)
    return Reply(**values)


def _call(stream: bool = False) -> ChatCall:
    return ChatCall("gemini", {"messages": []}, stream, "gemini-x")


def _sse(frames: list[bytes]) -> list[dict[str, Any]]:
    """The data of each frame, checking the ``data: …\\n\\n`` framing (one line, no event name)."""
    out = []
    for frame in frames:
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
        out.append(json.loads(frame.removeprefix(b"data: ")))
    return out


FULL_REPLY = _reply(
    reasoning="Think first.",
    content="Running it.",
    tool_calls=[ToolCall("call_9", "shell", '{"cmd": ["ls"]}'), ToolCall("call_10", "shell", "{}")],
    finish_reason="tool_calls",
)


# ---------------------------------------------------------------------------------------------- requests


def test_system_instruction_and_user_text_become_system_and_user_messages() -> None:
    system = {"role": "user", "parts": [{"text": "One."}, {"text": "Two."}]}
    assert _messages(_user("a", "b"), systemInstruction=system) == [
        {"role": "system", "content": "One.\n\nTwo."},
        {"role": "user", "content": "a\n\nb"},
    ]
    assert _messages(_user("hi"), systemInstruction="Plain.")[0] == {"role": "system", "content": "Plain."}


def test_a_content_without_a_role_and_the_older_function_role_are_user_turns() -> None:
    contents = [{"parts": [{"text": "go"}]}, _model(_fc()), {"role": "function", "parts": [_fr()]}]
    assert [m["role"] for m in _messages(*contents)] == ["user", "assistant", "tool"]


def test_model_thoughts_go_upstream_as_reasoning_and_signatures_are_dropped() -> None:
    turn = _model(
        {"text": "hmm", "thought": True},
        {"thoughtSignature": "c2ln"},
        {"text": "Looking.", "thoughtSignature": "c2ln"},
    )
    assert _messages(_user("go"), turn, _user("next"))[1] == {
        "role": "assistant",
        "content": "Looking.",
        "reasoning": "hmm",
    }


def test_function_calls_take_the_engines_json_spelling_and_a_raw_text_round_trips() -> None:
    turn = _model(_fc("shell", {"path": "é", "n": 1}, "c1"), _fc("shell", {"_raw": "not json"}, "c2"))
    messages = _messages(_user("go"), turn, _results(_fr(call_id="c1"), _fr(call_id="c2")))
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            _tool_call("c1", arguments='{"path": "é", "n": 1}'),
            _tool_call("c2", arguments="not json"),
        ],
    }


def test_results_are_matched_by_id_and_go_before_the_turns_text() -> None:
    turn = _model({"text": "Both."}, _fc("a", call_id="id_a"), _fc("b", call_id="id_b"))
    results = _results({"text": "and then?"}, _fr("b", {"r": "B"}, "id_b"), _fr("a", {"r": "Ä"}, "id_a"))
    assert _messages(_user("go"), turn, results)[2:] == [
        {"role": "tool", "tool_call_id": "id_b", "content": '{"r": "B"}'},
        {"role": "tool", "tool_call_id": "id_a", "content": '{"r": "Ä"}'},
        {"role": "user", "content": "and then?"},
    ]


def test_calls_without_ids_get_deterministic_ids_and_results_are_matched_by_name_in_order() -> None:
    contents = [
        _user("go"),
        _model(_fc("shell", {"n": 1}), _fc("read"), _fc("shell", {"n": 2})),
        # gemini-cli invents its own id for a call that had none: matched by name, first unanswered first.
        _results(_fr("shell", call_id="shell-1712-abc"), _fr("read"), _fr("shell")),
    ]
    messages = _messages(*contents)
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1_0", "call_1_1", "call_1_2"]
    assert [m["tool_call_id"] for m in messages[2:]] == ["call_1_0", "call_1_1", "call_1_2"]


def test_synthesized_ids_do_not_change_as_the_history_grows() -> None:
    history = [_user("go"), _model(_fc()), _results(_fr())]
    longer = [*history, _model({"text": "done"}, _fc("read")), _results(_fr("read"))]
    first, second = _messages(*history), _messages(*longer)
    assert second[: len(first)] == first and second[3]["tool_calls"][0]["id"] == "call_3_0"


def test_a_result_for_no_call_keeps_its_own_id_and_one_without_an_id_is_refused() -> None:
    assert _messages(_user("go"), _results(_fr(call_id="orphan")))[1]["tool_call_id"] == "orphan"
    error = _refusal(_request([_user("go"), _model(_fc("shell")), _results(_fr("read"))]))
    assert (
        error.message.startswith("contents[2].parts[0].functionResponse")
        and "no functionCall" in error.message
    )


def test_function_declarations_become_chat_tools_from_either_schema_field() -> None:
    gemini_schema = {
        "type": "OBJECT",
        "required": ["file_path"],
        "property_ordering": ["file_path", "lines"],
        "properties": {
            "file_path": {"type": "STRING", "nullable": True, "description": "Where."},
            "lines": {"type": "ARRAY", "items": {"type": "INTEGER"}, "min_items": 1},
            "mode": {"anyOf": [{"type": "STRING", "enum": ["a", "b"]}, {"type": "NUMBER"}]},
        },
    }
    tools = [
        {"functionDeclarations": [SHELL, {"name": "edit", "parameters": gemini_schema}]},
        {"function_declarations": [{"name": "snake", "parameters_json_schema": {"type": "object"}}]},
    ]
    call = DIALECT.parse_request(
        _request(tools=tools, toolConfig={"functionCallingConfig": {"mode": "AUTO"}})
    )
    assert [t["function"] for t in call.body["tools"]] == [
        {"name": "shell", "description": "Run.", "parameters": {"type": "object"}},
        {
            "name": "edit",
            "parameters": {
                "type": "object",
                "required": ["file_path"],
                "properties": {
                    "file_path": {"type": ["string", "null"], "description": "Where."},
                    "lines": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                    "mode": {"anyOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "number"}]},
                },
            },
        },
        {"name": "snake", "parameters": {"type": "object"}},
    ]
    assert call.body["tool_choice"] == "auto" and call.has_tools


@pytest.mark.parametrize(
    ("config", "choice"), [({"mode": "NONE"}, "none"), ({}, None), ({"mode": "AUTO"}, "auto")]
)
def test_function_calling_modes_auto_and_none_are_forwarded(
    config: dict[str, Any], choice: str | None
) -> None:
    body = DIALECT.parse_request(
        _request(tools=[{"functionDeclarations": [SHELL]}], toolConfig={"functionCallingConfig": config})
    ).body
    assert body.get("tool_choice") == choice


def test_no_declarations_means_no_tools_and_no_tool_choice() -> None:
    call = DIALECT.parse_request(
        _request(tools=[{"functionDeclarations": []}], toolConfig={"functionCallingConfig": {"mode": "NONE"}})
    )
    assert "tools" not in call.body and "tool_choice" not in call.body and not call.has_tools


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}, "toolConfig.functionCallingConfig.mode"),
        (
            {"toolConfig": {"functionCallingConfig": {"mode": "VALIDATED"}}},
            "toolConfig.functionCallingConfig.mode",
        ),
        (
            {"toolConfig": {"functionCallingConfig": {"mode": "AUTO", "allowedFunctionNames": ["shell"]}}},
            "toolConfig.functionCallingConfig.allowedFunctionNames",
        ),
        ({"generationConfig": {"responseMimeType": "application/json"}}, "generationConfig.responseMimeType"),
        ({"generationConfig": {"responseSchema": {"type": "OBJECT"}}}, "generationConfig.responseSchema"),
        (
            {"generationConfig": {"response_json_schema": {"type": "object"}}},
            "generationConfig.responseJsonSchema",
        ),
    ],
)
def test_constrained_decoding_is_refused_naming_the_field(fields: dict[str, Any], where: str) -> None:
    error = _refusal(_request(tools=[{"functionDeclarations": [SHELL]}], **fields))
    assert error.message.startswith(where) and "constrained decoding" in error.message


def test_text_plain_output_is_accepted() -> None:
    config = {"responseMimeType": "text/plain", "responseModalities": ["TEXT"], "candidateCount": 1}
    assert DIALECT.parse_request(_request(generationConfig=config)).agent_params == {
        "generationConfig": config
    }


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"generationConfig": {"candidateCount": 2}}, "generationConfig.candidateCount"),
        (
            {"generationConfig": {"responseModalities": ["TEXT", "IMAGE"]}},
            "generationConfig.responseModalities",
        ),
        ({"cachedContent": "cachedContents/abc"}, "cachedContent"),
        ({"tools": [{"googleSearch": {}}]}, "tools[0].googleSearch"),
        ({"tools": [{"functionDeclarations": [SHELL], "code_execution": {}}]}, "tools[0].codeExecution"),
    ],
)
def test_what_the_proxy_cannot_serve_is_refused_naming_it(fields: dict[str, Any], where: str) -> None:
    assert _refusal(_request(**fields)).message.startswith(where)


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"inlineData": {"mimeType": "image/png", "data": ""}}, "inlineData"),
        ({"file_data": {"fileUri": "gs://x"}}, "fileData"),
        ({"executableCode": {"code": "print(1)"}}, "'executableCode'"),
        ({"functionCall": {"name": "shell"}}, "'functionCall'"),
    ],
)
def test_non_text_user_parts_are_refused_naming_their_kind(part: dict[str, Any], kind: str) -> None:
    error = _refusal(_request([{"role": "user", "parts": [{"text": "see"}, part]}]))
    assert error.message.startswith("contents[0].parts[1]") and kind in error.message


def test_a_trailing_model_turn_is_refused_as_prefill() -> None:
    assert "prefill" in _refusal(_request([_user("go"), _model({"text": "Sure"})])).message


def test_media_in_a_function_response_is_refused() -> None:
    result = {"functionResponse": {"name": "shell", "response": {}, "parts": [{"inlineData": {}}]}}
    error = _refusal(_request([_user("go"), _model(_fc()), _results(result)]))
    assert error.message.startswith("contents[2].parts[0].functionResponse.parts")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"contents": [_user("hi")]}, "model"),
        (route_body({}, "gemini-x", False), "contents"),
        (_request([]), "contents"),
        (_request(["hi"]), "contents[0]"),
        (_request([{"role": "system", "parts": []}]), "contents[0].role"),
        (_request([{"role": "user", "parts": {"text": "x"}}]), "contents[0].parts"),
        (_request([{"role": "user", "parts": [{"text": 3}]}]), "contents[0].parts[0].text"),
        (
            _request([_user("go"), _model({"functionCall": {"args": {}}}), _user("x")]),
            "contents[1].parts[0].functionCall.name",
        ),
        (
            _request([_user("go"), _model(_fc(args=[1])), _user("x")]),
            "contents[1].parts[0].functionCall.args",
        ),
        (_request(generationConfig={"maxOutputTokens": 0}), "generationConfig.maxOutputTokens"),
        (_request(generationConfig={"stopSequences": "END"}), "generationConfig.stopSequences"),
        (_request(generationConfig=[1]), "generationConfig"),
        (_request(tools={"functionDeclarations": []}), "tools"),
        (
            _request(tools=[{"functionDeclarations": [{"description": "x"}]}]),
            "tools[0].functionDeclarations[0].name",
        ),
        (
            _request(toolConfig={"functionCallingConfig": {"mode": "SOMETIMES"}}),
            "toolConfig.functionCallingConfig.mode",
        ),
    ],
)
def test_a_missing_or_malformed_field_is_refused_naming_it(body: dict[str, Any], field: str) -> None:
    assert _refusal(body).message.startswith(field)


def test_generation_config_goes_to_agent_params_as_sent_and_only_the_cap_and_stops_into_the_body() -> None:
    config = {
        "temperature": 0.3,
        "topP": 0.8,
        "topK": 40.0,
        "seed": 5,
        "presencePenalty": 0.5,
        "maxOutputTokens": 100,
        "stopSequences": ["END"],
        "thinkingConfig": {"thinking_budget": 0},
    }
    fields = {
        "generationConfig": config,
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    }
    call = DIALECT.parse_request(_request(stream=True, **fields))
    assert call.agent_params == fields
    assert call.body["max_tokens"] == 100 and call.body["stop"] == ["END"]
    assert not SAMPLING_KEYS & call.body.keys() and "tool_choice" not in call.body  # no tools
    assert (call.stream, call.model, call.dialect) == (True, "gemini-x", "gemini")


def test_snake_case_fields_are_read_too() -> None:
    body = _request(
        system_instruction={"parts": [{"text": "S."}]},
        generation_config={"max_output_tokens": 7, "stop_sequences": ["X"]},
    )
    call = DIALECT.parse_request(body)
    assert call.body["messages"][0] == {"role": "system", "content": "S."}
    assert (call.body["max_tokens"], call.body["stop"]) == (7, ["X"])
    assert call.agent_params == {"generation_config": {"max_output_tokens": 7, "stop_sequences": ["X"]}}


def test_the_route_names_the_model_and_the_streaming_method() -> None:
    body = route_body({"contents": [_user("hi")], "model": "other", "stream": True}, "models/gemini-x", False)
    call = DIALECT.parse_request(body)
    assert (call.model, call.stream) == ("gemini-x", False)


# ----------------------------------------------------------------------------------------------- replies


def test_a_reply_validates_as_an_sdk_response_with_parts_in_order() -> None:
    body = DIALECT.render_reply(FULL_REPLY, _call())
    response = types.GenerateContentResponse.model_validate(body)
    parts = response.candidates[0].content.parts or []  # type: ignore[index,union-attr]
    assert [(p.thought, p.text) for p in parts[:2]] == [(True, "Think first."), (None, "Running it.")]
    assert [(c.id, c.name, c.args) for c in response.function_calls or []] == [
        ("call_9", "shell", {"cmd": ["ls"]}),
        ("call_10", "shell", {}),
    ]
    assert response.candidates[0].finish_reason == types.FinishReason.STOP  # type: ignore[index]
    assert (response.model_version, response.response_id) == ("gemini-x", "abc123")
    usage = response.usage_metadata
    assert usage is not None
    assert (usage.prompt_token_count, usage.candidates_token_count, usage.total_token_count) == (12, 5, 17)


def test_a_length_finish_is_max_tokens_and_arguments_that_are_not_an_object_stay_raw() -> None:
    capped = DIALECT.render_reply(_reply(finish_reason="length"), _call())
    assert capped["candidates"][0]["finishReason"] == "MAX_TOKENS"
    raw = DIALECT.render_reply(_reply(content=None, tool_calls=[ToolCall("c", "shell", "ls -la")]), _call())
    assert raw["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"id": "c", "name": "shell", "args": {"_raw": "ls -la"}}}
    ]


def test_an_empty_reply_still_has_one_text_part() -> None:
    body = DIALECT.render_reply(_reply(content=""), _call())
    assert body["candidates"][0]["content"] == {"role": "model", "parts": [{"text": ""}]}
    [frame] = _sse(list(DIALECT.render_stream(_reply(content=""), _call(stream=True))))
    assert frame == body


def test_the_stream_is_text_pieces_then_the_calls_with_the_finish_on_the_last_chunk() -> None:
    text = "y" * 150
    chunks = _sse(
        list(
            DIALECT.render_stream(
                _reply(content=text, reasoning="hm", tool_calls=FULL_REPLY.tool_calls), _call(True)
            )
        )
    )
    for chunk in chunks:
        types.GenerateContentResponse.model_validate(chunk)
        assert (chunk["modelVersion"], chunk["responseId"]) == ("gemini-x", "abc123")
    parts = [chunk["candidates"][0]["content"]["parts"] for chunk in chunks]
    assert parts[0] == [{"text": "hm", "thought": True}]
    assert [len(p[0]["text"]) for p in parts[1:4]] == [64, 64, 22] and "".join(
        p[0]["text"] for p in parts[1:4]
    ) == text
    assert [p["functionCall"]["id"] for p in parts[4]] == ["call_9", "call_10"] and len(parts) == 5
    assert [("finishReason" in c["candidates"][0], "usageMetadata" in c) for c in chunks] == [
        (False, False)
    ] * 4 + [(True, True)]
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert chunks[-1]["usageMetadata"] == DIALECT.render_reply(FULL_REPLY, _call())["usageMetadata"]


def test_a_capped_stream_ends_with_max_tokens() -> None:
    chunks = _sse(list(DIALECT.render_stream(_reply(finish_reason="length"), _call(stream=True))))
    assert chunks[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_javascript_line_separators_are_escaped_inside_a_frame() -> None:
    text = "a\u2028b\u2029c"
    [frame] = list(DIALECT.render_stream(_reply(content=text), _call(stream=True)))
    assert "\u2028".encode() not in frame and "\u2029".encode() not in frame
    assert _sse([frame])[0]["candidates"][0]["content"]["parts"] == [{"text": text}]


def _sdk_client(reply: Reply, status: int = 200) -> genai.Client:
    """A client whose every call is answered by the dialect (or, with ``status``, by its error)."""

    def engine(request: httpx.Request) -> httpx.Response:
        model, _, method = request.url.path.rsplit("/", 1)[-1].partition(":")
        call = DIALECT.parse_request(
            route_body(json.loads(request.content), model, method.startswith("stream"))
        )
        if status != 200:
            return httpx.Response(status, json=DIALECT.render_error(status, "nope"))
        if call.stream:
            frames = b"".join(DIALECT.render_stream(reply, call))
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=frames)
        return httpx.Response(200, json=DIALECT.render_reply(reply, call))

    options = types.HttpOptions(
        base_url="http://proxy", httpx_client=httpx.Client(transport=httpx.MockTransport(engine))
    )
    return genai.Client(api_key="session", http_options=options)


def test_the_sdk_client_parses_replies_and_streams() -> None:
    client = _sdk_client(FULL_REPLY)
    response = client.models.generate_content(model="gemini-x", contents="go")
    assert response.text == "Running it." and [c.id for c in response.function_calls or []] == [
        "call_9",
        "call_10",
    ]
    chunks = list(client.models.generate_content_stream(model="gemini-x", contents="go"))
    assert "".join(chunk.text or "" for chunk in chunks) == "Running it."
    assert [c.id for c in chunks[-1].function_calls or []] == ["call_9", "call_10"]
    assert chunks[-1].usage_metadata == response.usage_metadata


@pytest.mark.parametrize(
    ("status", "name", "kind"),
    [
        (400, "INVALID_ARGUMENT", errors.ClientError),
        (401, "UNAUTHENTICATED", errors.ClientError),
        (404, "NOT_FOUND", errors.ClientError),
        (413, "INVALID_ARGUMENT", errors.ClientError),
        (429, "RESOURCE_EXHAUSTED", errors.ClientError),
        (500, "INTERNAL", errors.ServerError),
        (502, "UNAVAILABLE", errors.ServerError),
        (504, "DEADLINE_EXCEEDED", errors.ServerError),
    ],
)
def test_errors_use_googles_shape_and_raise_the_sdks_error_types(status: int, name: str, kind: type) -> None:
    assert DIALECT.render_error(status, "nope") == {
        "error": {"code": status, "message": "nope", "status": name}
    }
    client = _sdk_client(FULL_REPLY, status)
    with pytest.raises(kind) as caught:
        client.models.generate_content(model="gemini-x", contents="go")
    error: errors.APIError = caught.value  # type: ignore[assignment]
    assert (error.code, error.status, error.message) == (status, name, "nope")


def test_a_stream_error_is_a_data_frame_the_sdk_raises_as_a_server_error() -> None:
    frame = DIALECT.render_stream_error(502, "engine down")
    assert _sse([frame]) == [{"error": {"code": 502, "message": "engine down", "status": "UNAVAILABLE"}}]

    def engine(request: httpx.Request) -> httpx.Response:
        call = DIALECT.parse_request(route_body(json.loads(request.content), "gemini-x", True))
        first = next(iter(DIALECT.render_stream(_reply(content="partial"), call)))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=first + frame)

    options = types.HttpOptions(
        base_url="http://proxy", httpx_client=httpx.Client(transport=httpx.MockTransport(engine))
    )
    client = genai.Client(api_key="session", http_options=options)
    with pytest.raises(errors.ServerError) as caught:
        list(client.models.generate_content_stream(model="gemini-x", contents="go"))
    assert (caught.value.code, caught.value.message) == (502, "engine down")


# ------------------------------------------------------------------------------------------ count_tokens


def test_count_tokens_estimates_the_request_in_either_form() -> None:
    contents = [_user("word " * 400)]
    direct = count_tokens({"contents": contents})["totalTokens"]
    wrapped = count_tokens({"generateContentRequest": {"model": "models/x", "contents": contents}})[
        "totalTokens"
    ]
    assert direct == wrapped and 500 <= direct <= 520
    assert count_tokens({"contents": []}) == {"totalTokens": 1}
    with pytest.raises(DialectError, match="contents"):
        count_tokens({"model": "gemini-x"})
