"""The official ``openai`` SDK's Responses client against the capture proxy and the fake engine.

The session id is the API key (``Authorization: Bearer``); ``base_url`` is the session's ``…/v1``. The
fake engine answers ``SAY:<text>`` with that text and ``CALL:<name>:<json>`` with a tool call (see
``tests/proxy/fake_engine.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from tests.proxy.conftest import Stack
from tests.proxy.fake_engine import ServerThread

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    "strict": False,
}


def _client(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        api_key=session["session_id"], base_url=session["base_url"], max_retries=0, timeout=30
    )


def _ask(client: openai.OpenAI, stream: bool, **request: Any) -> Response:
    request = {"model": "gpt-x", **request}
    if not stream:
        return client.responses.create(**request)
    with client.responses.stream(**request) as events:
        for _ in events:
            pass
        return events.get_final_response()


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_is_answered_and_journaled_once(stack: Stack, stream: bool) -> None:
    session = stack.new_session()
    response = _ask(_client(session), stream, instructions="Be brief.", input="SAY:hello there")
    assert response.output_text == "hello there" and response.status == "completed"
    assert response.model == "gpt-x" and response.usage is not None and response.usage.output_tokens > 0
    [record] = stack.calls(session["session_id"])
    assert record["dialect"] == "responses" and record["kind"] == "model"
    assert record["upstream_request"]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_the_raw_event_stream_is_numbered_and_ends_completed(stack: Stack) -> None:
    client = _client(stack.new_session())
    events = list(client.responses.create(model="gpt-x", input="SAY:" + "word " * 40, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:3]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert events[-1].type == "response.completed"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "word " * 40


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trips_and_the_next_call_extends_the_first(stack: Stack, stream: bool) -> None:
    session = stack.new_session()
    client = _client(session)
    history: list[Any] = [_user('list the files CALL:shell:{"command": "ls"}')]
    first = _ask(client, stream, tools=[SHELL], input=history)
    [call] = first.output
    assert call.type == "function_call" and call.name == "shell"
    assert call.arguments == '{"command": "ls"}'

    history += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"},
    ]
    second = _ask(client, stream, tools=[SHELL], input=history)
    assert second.output_text == "ok: a.txt"

    turns = stack.trace(session["session_id"])["turns"]
    assert [turn["metadata"]["parent"] for turn in turns] == [None, turns[0]["node_id"]]


def test_an_output_cap_answers_an_incomplete_response(stack: Stack) -> None:
    client = _client(stack.new_session())
    response = _ask(client, False, max_output_tokens=4, input="SAY:a long answer")
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    events = list(
        client.responses.create(model="gpt-x", max_output_tokens=4, input="SAY:a long answer", stream=True)
    )
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize(
    "request_fields",
    [
        {"tools": [SHELL], "tool_choice": "required"},
        {"tools": [SHELL], "tool_choice": {"type": "function", "name": "shell"}},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
        {"text": {"format": {"type": "json_object"}}},
        {"tools": [{"type": "web_search"}]},
        {"previous_response_id": "resp_123"},
    ],
)
def test_a_refused_request_raises_bad_request_and_spends_nothing(stack: Stack, request_fields: Any) -> None:
    session = stack.new_session(max_model_calls=1)
    client = _client(session)
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, False, input="SAY:hi", **request_fields)
    assert caught.value.type == "invalid_request_error"
    assert stack.calls(session["session_id"]) == []
    assert _ask(client, False, input="SAY:still here").output_text == "still here"


def test_an_unknown_api_key_raises_authentication_error(stack: Stack) -> None:
    client = _client({"session_id": "no-such-session", "base_url": stack.url + "/v1"})
    with pytest.raises(openai.AuthenticationError):
        _ask(client, False, input="hi")


def test_a_spent_budget_answers_a_final_response_in_both_modes(stack: Stack) -> None:
    session = stack.new_session(max_model_calls=1)
    client = _client(session)
    _ask(client, False, input="SAY:first")
    for stream in (False, True):
        final = _ask(client, stream, tools=[SHELL], input="SAY:second")
        assert final.status == "completed" and "budget" in final.output_text.lower()


@pytest.fixture
def slow_stack(servers: ServerThread, tmp_path: Path) -> Iterator[Stack]:
    """A proxy that opens streams quickly (keepalives) and gives up on the engine quickly."""
    stack = Stack(servers, tmp_path / "data", keepalive_s=0.05, upstream_timeout_s=0.3, upstream_attempts=1)
    yield stack
    stack.close()
    for runner in list(servers.runners):
        servers.stop_runner(runner)


def test_an_engine_failure_after_the_stream_opened_arrives_as_an_error_event(slow_stack: Stack) -> None:
    session = slow_stack.new_session()
    slow_stack.engine.faults = [{"mode": "timeout", "seconds": 3}]  # set before the request; read after
    [event] = list(_client(session).responses.create(model="gpt-x", input="SAY:never", stream=True))
    assert event.type == "error" and "timed out" in event.message and event.code == "server_error"
