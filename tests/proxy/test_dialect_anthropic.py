"""The Anthropic Messages dialect, pure: request translation, refusals, reply and SSE rendering.

Shapes are checked with the official ``anthropic`` SDK's own types, and once end to end through the SDK
client over an in-memory transport (no proxy, no network).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse

from capture_proxy.dialects.anthropic import DIALECT, tool_arguments, tool_input
from capture_proxy.dialects.base import ChatCall, DialectError, Reply, ToolCall
from capture_proxy.dialects.count_tokens import count_tokens

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "stream", "model", "logprobs", "top_logprobs"}
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def _request(messages: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "claude-x", "max_tokens": 256, "messages": messages or [_user("hi")]}
    body.update(fields)
    return body


def _user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _messages(*messages: dict[str, Any], **fields: Any) -> list[dict[str, Any]]:
    return DIALECT.parse_request(_request(list(messages), **fields)).body["messages"]


def _refusal(body: dict[str, Any]) -> DialectError:
    with pytest.raises(DialectError) as caught:
        DIALECT.parse_request(body)
    assert caught.value.status == 400
    return caught.value


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
    return ChatCall("anthropic", {"messages": []}, stream, "claude-x")


def _sse(frames: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each frame, checking the ``event: …\\ndata: …\\n\\n`` framing."""
    out = []
    for frame in frames:
        assert frame.endswith(b"\n\n") and frame.count(b"\n") == 3
        event_line, data_line = frame.decode().rstrip("\n").split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        out.append((event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return out


BASH = ToolCall("call_1", "bash", '{"command": "ls -la"}')
THINKING_TOOL_REPLY = _reply(
    reasoning="Let me look.", content="Listing files.", tool_calls=[BASH], finish_reason="tool_calls"
)


# ---------------------------------------------------------------------------------------------- requests


def test_string_system_and_string_content_become_system_and_user_messages() -> None:
    assert _messages(_user("hi"), system="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_system_text_blocks_join_with_a_blank_line() -> None:
    system = [
        {"type": "text", "text": "One.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Two."},
    ]
    assert _messages(_user("hi"), system=system)[0] == {"role": "system", "content": "One.\n\nTwo."}


def test_user_text_blocks_join_with_a_blank_line() -> None:
    blocks = [
        {"type": "text", "text": "<system-reminder>x</system-reminder>"},
        {"type": "text", "text": "do it"},
    ]
    assert _messages(_user(blocks)) == [
        {"role": "user", "content": "<system-reminder>x</system-reminder>\n\ndo it"}
    ]


def test_assistant_tool_use_becomes_tool_calls_with_the_engines_json_spelling() -> None:
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls", "path": "é"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}
    messages = _messages(_user("go"), _assistant([tool_use]), _user([result]))
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls", "path": "é"}'},
            }
        ],
    }


def test_assistant_text_and_tool_use_share_one_message() -> None:
    blocks = [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "t1", "name": "bash", "input": {}},
    ]
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
    message = _messages(_user("go"), _assistant(blocks), _user([result]))[1]
    assert message["content"] == "Looking." and message["tool_calls"][0]["function"]["arguments"] == "{}"


def test_tool_results_become_tool_messages_before_the_turns_text() -> None:
    tool_uses = [{"type": "tool_use", "id": f"t{i}", "name": "bash", "input": {"i": i}} for i in (1, 2)]
    turn = [
        {"type": "text", "text": "Also, hurry."},
        {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
        {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "two"}]},
    ]
    messages = _messages(_user("go"), _assistant(tool_uses), _user(turn))
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "two"},
        {"role": "user", "content": "Also, hurry."},
    ]


def test_tool_result_errors_keep_their_text_without_a_prefix() -> None:
    tool_use = {"type": "tool_use", "id": "t1", "name": "bash", "input": {}}
    content = [
        {"type": "text", "text": "<tool_use_error>boom</tool_use_error>"},
        {"type": "text", "text": "x"},
    ]
    result = {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": content}
    messages = _messages(_user("go"), _assistant([tool_use]), _user([result]))
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": "<tool_use_error>boom</tool_use_error>\n\nx",
    }


def test_tool_result_without_content_is_an_empty_tool_message() -> None:
    tool_use = {"type": "tool_use", "id": "t1", "name": "bash", "input": {}}
    messages = _messages(
        _user("go"), _assistant([tool_use]), _user([{"type": "tool_result", "tool_use_id": "t1"}])
    )
    assert messages[2] == {"role": "tool", "tool_call_id": "t1", "content": ""}


def test_thinking_goes_upstream_as_reasoning_and_redacted_thinking_is_dropped() -> None:
    blocks = [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "text", "text": "Done."},
    ]
    assert _messages(_user("go"), _assistant(blocks), _user("thanks"))[1] == {
        "role": "assistant",
        "content": "Done.",
        "reasoning": "hmm",
    }


def test_raw_tool_input_maps_back_to_the_engines_exact_text() -> None:
    arguments = '{"command": "ls"'  # truncated JSON, as a model may write it
    assert tool_input(arguments) == {"_raw": arguments}
    assert tool_arguments(tool_input(arguments)) == arguments
    assert tool_input("[1, 2]") == {"_raw": "[1, 2]"}
    assert tool_input("  ") == {}


@pytest.mark.parametrize("kind", ["image", "document"])
def test_media_blocks_are_refused_naming_the_block(kind: str) -> None:
    error = _refusal(_request([_user([{"type": "text", "text": "see"}, {"type": kind, "source": {}}])]))
    assert "messages[0].content[1]" in error.message and "not supported" in error.message


def test_an_image_inside_a_tool_result_is_refused() -> None:
    tool_use = {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]}
    error = _refusal(_request([_user("go"), _assistant([tool_use]), _user([result])]))
    assert "messages[2].content[0].content[0]" in error.message and "image" in error.message


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "bash"}])
def test_forced_tool_choice_is_refused_as_constrained_decoding(choice: dict[str, Any]) -> None:
    error = _refusal(
        _request(tools=[{"name": "bash", "input_schema": {"type": "object"}}], tool_choice=choice)
    )
    assert error.message.startswith("tool_choice") and "constrained decoding" in error.message
    assert error.param == "tool_choice"


@pytest.mark.parametrize("kind", ["auto", "none"])
def test_auto_and_none_tool_choice_pass_through(kind: str) -> None:
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    body = DIALECT.parse_request(_request(tools=tools, tool_choice={"type": kind})).body
    assert body["tool_choice"] == kind


def test_tools_become_function_tools() -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}}
    tools = [
        {"name": "bash", "description": "Run it.", "input_schema": schema, "cache_control": {"type": "x"}}
    ]
    call = DIALECT.parse_request(_request(tools=tools))
    assert call.body["tools"] == [
        {"type": "function", "function": {"name": "bash", "description": "Run it.", "parameters": schema}}
    ]
    assert call.has_tools


def test_structured_output_is_refused_as_constrained_decoding() -> None:
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    error = _refusal(_request(output_config={"effort": "low", "format": schema}))
    assert error.message.startswith("output_config.format") and "constrained decoding" in error.message
    assert _refusal(_request(output_format=schema)).message.startswith("output_format")
    assert DIALECT.parse_request(_request(output_config={"effort": "low"})).agent_params["output_config"]


def test_strict_tools_are_forwarded_without_strict() -> None:
    tools = [{"name": "bash", "input_schema": {"type": "object"}, "strict": True}]
    assert "strict" not in DIALECT.parse_request(_request(tools=tools)).body["tools"][0]["function"]


def test_a_server_tool_is_refused_naming_its_type() -> None:
    error = _refusal(_request(tools=[{"type": "web_search_20250305", "name": "web_search"}]))
    assert "tools[0]" in error.message and "web_search_20250305" in error.message


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": None}, "model"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_a_missing_or_malformed_field_is_refused_naming_it(change: dict[str, Any], field: str) -> None:
    body = {key: value for key, value in {**_request(), **change}.items() if value is not None}
    assert _refusal(body).message.startswith(field)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert "JSON object" in _refusal([]).message  # type: ignore[arg-type]


def test_a_trailing_assistant_prefill_is_refused() -> None:
    assert "prefill" in _refusal(_request([_user("hi"), _assistant("The answer is")])).message


def test_sampling_goes_to_agent_params_and_never_into_the_body() -> None:
    fields = {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u"},
        "stream": True,
    }
    call = DIALECT.parse_request(_request(**fields))
    assert call.agent_params == {**{k: v for k, v in fields.items() if k != "stream"}, "max_tokens": 256}
    assert call.body["stop"] == ["END"] and call.body["max_tokens"] == 256
    assert not SAMPLING_KEYS & call.body.keys()
    assert (call.stream, call.model, call.dialect) == (True, "claude-x", "anthropic")


# ----------------------------------------------------------------------------------------------- replies


def test_a_reply_with_thinking_text_and_a_tool_call_validates_as_an_sdk_message() -> None:
    body = DIALECT.render_reply(THINKING_TOOL_REPLY, _call())
    message = Message.model_validate(body)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.id == "msg_abc123" and message.model == "claude-x"
    assert message.content[2].input == {"command": "ls -la"}  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"
    assert body["usage"] == {
        "input_tokens": 12,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


@pytest.mark.parametrize(
    ("reply", "stop_reason", "stop_sequence"),
    [
        (_reply(), "end_turn", None),
        (_reply(finish_reason="length"), "max_tokens", None),
        (_reply(stop_sequence="END"), "stop_sequence", "END"),
        (_reply(content=None, tool_calls=[BASH], finish_reason="tool_calls"), "tool_use", None),
    ],
)
def test_finish_reasons_map_to_anthropic_stop_reasons(
    reply: Reply, stop_reason: str, stop_sequence: Any
) -> None:
    body = DIALECT.render_reply(reply, _call())
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)


def test_an_empty_reply_has_no_content_blocks() -> None:
    assert Message.model_validate(DIALECT.render_reply(_reply(content=""), _call())).content == []


def test_the_stream_is_the_exact_messages_event_sequence() -> None:
    events = _sse(list(DIALECT.render_stream(THINKING_TOOL_REPLY, _call(stream=True))))
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    for _, data in events:
        EVENTS.validate_python(data)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 1 and start["stop_reason"] is None
    assert [data["delta"]["type"] for _, data in events if data["type"] == "content_block_delta"] == [
        "thinking_delta",
        "signature_delta",
        "text_delta",
        "input_json_delta",
    ]
    assert (
        events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["output_tokens"] == 5
    )


def test_long_text_streams_in_small_deltas_that_add_up() -> None:
    text = "x" * 1000 + "é" * 30
    events = _sse(list(DIALECT.render_stream(_reply(content=text), _call(stream=True))))
    deltas = [data["delta"]["text"] for _, data in events if data["type"] == "content_block_delta"]
    assert len(deltas) > 10 and max(map(len, deltas)) <= 64 and "".join(deltas) == text


def test_the_sdk_client_parses_a_reply_and_rebuilds_the_streamed_message() -> None:
    def engine(request: httpx2.Request) -> httpx2.Response:
        call = DIALECT.parse_request(json.loads(request.content))
        headers = {"content-type": "text/event-stream" if call.stream else "application/json"}
        if call.stream:
            return httpx2.Response(
                200, headers=headers, content=b"".join(DIALECT.render_stream(THINKING_TOOL_REPLY, call))
            )
        return httpx2.Response(200, headers=headers, json=DIALECT.render_reply(THINKING_TOOL_REPLY, call))

    client = anthropic.Anthropic(
        api_key="session",
        base_url="http://proxy",
        http_client=httpx2.Client(transport=httpx2.MockTransport(engine)),
        _strict_response_validation=True,
    )
    request: dict[str, Any] = {
        "model": "claude-x",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "go"}],
    }
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump() == message.model_dump()
    assert message.content[2].input == {"command": "ls -la"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (529, "overloaded_error"),
        (413, "request_too_large"),
    ],
)
def test_errors_carry_the_apis_error_type_for_their_status(status: int, kind: str) -> None:
    body = DIALECT.render_error(status, "nope")
    assert body == {"type": "error", "error": {"type": kind, "message": "nope"}}
    if kind != "request_too_large":  # the API's 413 type, which this SDK's union does not list
        ErrorResponse.model_validate(body)


def test_a_stream_error_is_an_error_event() -> None:
    [(name, data)] = _sse([DIALECT.render_stream_error(529, "busy")])
    assert name == "error" and data == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }


# ------------------------------------------------------------------------------------------ count_tokens


def test_count_tokens_estimates_a_quarter_of_the_serialized_bytes() -> None:
    small = count_tokens({"model": "m", "messages": [_user("hi")]})["input_tokens"]
    big = count_tokens({"messages": [_user("word " * 400)], "system": "s", "tools": []})["input_tokens"]
    assert small == 9  # '[[{"role":"user","content":"hi"}]]' is 35 bytes
    assert 500 <= big <= 520


def test_count_tokens_is_at_least_one_and_refuses_a_body_without_messages() -> None:
    assert count_tokens({"messages": []}) == {"input_tokens": 1}
    with pytest.raises(DialectError, match="messages"):
        count_tokens({"model": "claude-x"})


def test_a_mid_conversation_system_message_goes_upstream_as_a_system_message() -> None:
    messages = _messages(
        _user("go"), _assistant("ok"), {"role": "system", "content": "Be brief."}, _user("next")
    )
    assert messages[2] == {"role": "system", "content": "Be brief."}
