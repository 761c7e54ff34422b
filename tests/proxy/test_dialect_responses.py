"""The OpenAI Responses dialect, pure: request translation, refusals, reply and SSE rendering.

Shapes are checked with the official ``openai`` SDK's own types, and end to end through the SDK client
over an in-memory transport (no proxy, no network).
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent

from capture_proxy.dialects.base import ChatCall, DialectError, Reply, ToolCall
from capture_proxy.dialects.responses import DIALECT

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "stream", "model", "logprobs", "top_logprobs"}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
SHELL_TOOL = {"type": "function", "name": "shell", "description": "Run.", "parameters": {"type": "object"}}


def _request(input_: Any = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "gpt-x", "input": input_, **fields}


def _messages(input_: Any, **fields: Any) -> list[dict[str, Any]]:
    return DIALECT.parse_request(_request(input_, **fields)).body["messages"]


def _refusal(body: Any) -> DialectError:
    with pytest.raises(DialectError) as caught:
        DIALECT.parse_request(body)
    assert caught.value.status == 400
    return caught.value


def _msg(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _fc(call_id: str, arguments: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "shell", "arguments": arguments}


def _out(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def _tool_call(call_id: str, arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": arguments}}


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
    return ChatCall("responses", {"messages": []}, stream, "gpt-x")


def _sse(frames: list[bytes]) -> list[dict[str, Any]]:
    """The data of each frame, checking the ``event: TYPE\\ndata: …\\n\\n`` framing against ``type``."""
    out = []
    for frame in frames:
        assert frame.endswith(b"\n\n") and frame.count(b"\n") == 3
        event_line, data_line = frame.decode().rstrip("\n").split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        out.append(data)
    return out


FULL_REPLY = _reply(
    reasoning="Think first.",
    content="Running it.",
    tool_calls=[ToolCall("call_1", "shell", '{"cmd": ["ls"]}'), ToolCall("call_2", "shell", "{}")],
    finish_reason="tool_calls",
)


# ---------------------------------------------------------------------------------------------- requests


def test_string_input_becomes_one_user_message_after_the_instructions() -> None:
    assert _messages("hi", instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_developer_and_system_items_become_system_messages() -> None:
    items = [_msg("developer", "rules"), {"role": "system", "content": "more"}, _msg("user", "go")]
    assert _messages(items) == [
        {"role": "system", "content": "rules"},
        {"role": "system", "content": "more"},
        {"role": "user", "content": "go"},
    ]


def test_an_item_with_a_role_but_no_type_is_a_message() -> None:
    assert _messages([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]


def test_text_blocks_of_one_message_join_with_a_blank_line() -> None:
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": t} for t in ("a", "b")],
    }
    assert _messages([item]) == [{"role": "user", "content": "a\n\nb"}]


def test_function_calls_merge_into_the_assistant_message_before_them() -> None:
    items = [
        _msg("user", "go"),
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
        _msg("assistant", "Running."),
        _fc("c1"),
        _fc("c2", '{"a": 1}'),
        _out("c1", "one"),
        _out("c2", [{"type": "input_text", "text": "two"}]),
    ]
    assert _messages(items) == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Running.",
            "tool_calls": [_tool_call("c1"), _tool_call("c2", '{"a": 1}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_a_function_call_after_a_tool_result_starts_an_assistant_message_with_null_content() -> None:
    items = [_msg("user", "go"), _fc("c1"), _out("c1", "one"), _fc("c2")]
    messages = _messages(items)
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [_tool_call("c1")]}
    assert messages[3] == {"role": "assistant", "content": None, "tool_calls": [_tool_call("c2")]}


def test_encrypted_reasoning_items_are_dropped() -> None:
    items = [_msg("user", "go"), {"type": "reasoning", "id": "rs_1", "summary": []}, _msg("assistant", "ok")]
    assert _messages(items) == [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]


def test_reasoning_text_goes_upstream_on_the_assistant_message_that_follows() -> None:
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hmm"}],
    }
    items = [_msg("user", "go"), thought, _fc("c1"), _out("c1", "one")]
    assert _messages(items)[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [_tool_call("c1")],
        "reasoning": "hmm",
    }


def test_function_tools_become_chat_tools_without_strict() -> None:
    call = DIALECT.parse_request(_request(tools=[{**SHELL_TOOL, "strict": True}], tool_choice="auto"))
    assert call.body["tools"] == [
        {
            "type": "function",
            "function": {"name": "shell", "description": "Run.", "parameters": {"type": "object"}},
        }
    ]
    assert call.body["tool_choice"] == "auto"


@pytest.mark.parametrize("kind", ["web_search", "custom", "local_shell"])
def test_a_non_function_tool_is_refused_naming_its_type(kind: str) -> None:
    error = _refusal(_request(tools=[SHELL_TOOL, {"type": kind, "name": "x"}]))
    assert error.message.startswith("tools[1].type") and repr(kind) in error.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "shell"}])
def test_forced_tool_choice_is_refused_as_constrained_decoding(choice: Any) -> None:
    error = _refusal(_request(tools=[SHELL_TOOL], tool_choice=choice))
    assert error.message.startswith("tool_choice") and "constrained decoding" in error.message


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_structured_output_is_refused_as_constrained_decoding(kind: str) -> None:
    error = _refusal(_request(text={"format": {"type": kind, "name": "x", "schema": {}}}))
    assert error.message.startswith("text.format") and error.param == "text.format"


def test_previous_response_id_is_refused_because_the_proxy_is_stateless() -> None:
    error = _refusal(_request(previous_response_id="resp_1"))
    assert error.message.startswith("previous_response_id") and "stateless" in error.message


def test_an_unsupported_item_type_is_refused_naming_it() -> None:
    error = _refusal(_request([_msg("user", "go"), {"type": "web_search_call", "id": "ws"}]))
    assert error.message.startswith("input[1].type") and "web_search_call" in error.message


def test_an_image_is_refused_as_unsupported() -> None:
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}
    assert "input[0].content[0]: input_image" in _refusal(_request([item])).message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "hi"}, "model"),
        ({"model": "gpt-x"}, "input"),
        (_request([]), "input"),
        (_request([{"type": "reasoning", "summary": []}]), "input"),
        (_request(["hi"]), "input[0]"),
        (_request([{"role": "tool", "content": "x"}]), "input[0].role"),
        (_request([{"type": "function_call", "name": "shell", "arguments": "{}"}]), "input[0].call_id"),
        (_request([{"role": "user", "content": 3}]), "input[0].content"),
        (_request(max_output_tokens=0), "max_output_tokens"),
        (_request(instructions=["x"]), "instructions"),
        (_request(tools={"type": "function"}), "tools"),
        (_request(stream="yes"), "stream"),
    ],
)
def test_a_missing_or_malformed_field_is_refused_naming_it(body: dict[str, Any], field: str) -> None:
    assert _refusal(body).message.startswith(field)


def test_sampling_goes_to_agent_params_and_only_the_output_cap_into_the_body() -> None:
    fields = {
        "temperature": 0.3,
        "top_p": 0.8,
        "max_output_tokens": 100,
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "store": False,
        "parallel_tool_calls": True,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
    }
    call = DIALECT.parse_request(_request(**fields))
    assert call.agent_params == {k: v for k, v in fields.items() if k not in ("stream", "include")}
    assert call.body["max_tokens"] == 100 and not SAMPLING_KEYS & call.body.keys()
    assert (call.stream, call.model, call.dialect) == (True, "gpt-x", "responses")


# ----------------------------------------------------------------------------------------------- replies


def test_a_reply_validates_as_an_sdk_response_with_items_in_order() -> None:
    body = DIALECT.render_reply(FULL_REPLY, _call())
    response = Response.model_validate(body)
    assert [item.type for item in response.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert response.output_text == "Running it." and response.status == "completed"
    assert response.id == "resp_abc123" and response.model == "gpt-x" and response.created_at == 1_700_000_000
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.arguments) for c in calls] == [("call_1", '{"cmd": ["ls"]}'), ("call_2", "{}")]
    assert len({item.id for item in response.output}) == 4
    assert body["usage"]["total_tokens"] == 17


def test_a_length_finish_renders_an_incomplete_response() -> None:
    response = Response.model_validate(DIALECT.render_reply(_reply(finish_reason="length"), _call()))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_the_stream_is_the_responses_event_sequence_numbered_from_zero() -> None:
    events = _sse(list(DIALECT.render_stream(FULL_REPLY, _call(stream=True))))
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    item_events = ["response.output_item.added", "response.content_part.added"]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *item_events,
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *item_events,
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *[
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        * 2,
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["response"] == DIALECT.render_reply(FULL_REPLY, _call())


def test_a_capped_stream_ends_with_response_incomplete() -> None:
    events = _sse(list(DIALECT.render_stream(_reply(finish_reason="length"), _call(stream=True))))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_long_text_streams_in_small_deltas_that_add_up() -> None:
    text = "y" * 700 + "ü" * 10
    events = _sse(list(DIALECT.render_stream(_reply(content=text), _call(stream=True))))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 10 and max(map(len, deltas)) <= 64 and "".join(deltas) == text


def _sdk_client(reply: Reply) -> openai.OpenAI:
    def engine(request: httpx2.Request) -> httpx2.Response:
        call = DIALECT.parse_request(json.loads(request.content))
        if call.stream:
            frames = b"".join(DIALECT.render_stream(reply, call))
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=frames)
        return httpx2.Response(200, json=DIALECT.render_reply(reply, call))

    http_client = httpx2.Client(transport=httpx2.MockTransport(engine))
    return openai.OpenAI(
        api_key="session",
        base_url="http://proxy/v1",
        http_client=http_client,
        _strict_response_validation=True,
    )


def test_the_sdk_client_parses_replies_and_streams() -> None:
    client = _sdk_client(FULL_REPLY)
    request: dict[str, Any] = {"model": "gpt-x", "input": "go", "tools": [SHELL_TOOL]}
    response = client.responses.create(**request)
    assert response.output_text == "Running it."
    events = list(client.responses.create(**request, stream=True))
    assert events[-1].type == "response.completed"
    with client.responses.stream(**request) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "Running it." and final.output_text == "Running it."
    assert [item.type for item in final.output] == [item.type for item in response.output]


def test_errors_use_openais_error_shape() -> None:
    assert DIALECT.render_error(400, "bad") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert DIALECT.render_error(401, "who")["error"]["type"] == "authentication_error"
    assert DIALECT.render_error(429, "slow")["error"]["code"] == "rate_limit_exceeded"
    assert DIALECT.render_error(502, "down")["error"]["type"] == "server_error"


def test_a_stream_error_is_an_sdk_error_event() -> None:
    [data] = _sse([DIALECT.render_stream_error(502, "engine down")])
    event = ResponseErrorEvent.model_validate(data)
    assert (event.message, event.code, event.param) == ("engine down", "server_error", None)
