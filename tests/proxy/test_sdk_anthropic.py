"""The official ``anthropic`` SDK against the capture proxy and the fake engine, over real HTTP.

The session id is the API key (sent as ``x-api-key``); ``base_url`` is the proxy's root (the SDK adds
``/v1/messages``). The fake engine answers ``SAY:<text>`` with that text and ``CALL:<name>:<json>`` with
a tool call (see ``tests/proxy/fake_engine.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic.types import Message

from tests.proxy.conftest import Stack
from tests.proxy.fake_engine import ServerThread

BASH = {"name": "bash", "description": "Run a command.", "input_schema": {"type": "object"}}


def _client(session: dict[str, Any]) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key=session["session_id"], base_url=session["root_url"], max_retries=0, timeout=30
    )


def _user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _ask(client: anthropic.Anthropic, stream: bool, **request: Any) -> Message:
    request = {"model": "claude-x", "max_tokens": 256, **request}
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_is_answered_and_journaled_once(stack: Stack, stream: bool) -> None:
    session = stack.new_session()
    message = _ask(_client(session), stream, system="Be brief.", messages=[_user("SAY:hello there")])
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "hello there"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.model == "claude-x"
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    [record] = stack.calls(session["session_id"])
    assert record["dialect"] == "anthropic" and record["kind"] == "model"
    assert record["upstream_request"]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_the_raw_event_stream_is_the_messages_sequence(stack: Stack) -> None:
    client = _client(stack.new_session())
    request = {
        "model": "claude-x",
        "max_tokens": 256,
        "messages": [_user("SAY:" + "word " * 40)],
        "stream": True,
    }
    names = [event.type for event in client.messages.create(**request)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert names.count("content_block_delta") > 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trips_and_the_next_call_extends_the_first(stack: Stack, stream: bool) -> None:
    session = stack.new_session()
    client = _client(session)
    history = [_user('list the files CALL:bash:{"command": "ls"}')]
    first = _ask(client, stream, tools=[BASH], messages=history)
    assert first.stop_reason == "tool_use"
    [tool_use] = first.content
    assert tool_use.type == "tool_use" and tool_use.name == "bash" and tool_use.input == {"command": "ls"}

    result = {"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.txt b.txt"}
    history += [{"role": "assistant", "content": first.content}, _user([result])]
    second = _ask(client, stream, tools=[BASH], messages=history)
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "ok: a.txt b.txt"  # type: ignore[union-attr]

    turns = stack.trace(session["session_id"])["turns"]
    assert [turn["metadata"]["parent"] for turn in turns] == [None, turns[0]["node_id"]]
    assert stack.calls(session["session_id"])[1]["upstream_request"]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": tool_use.id,
        "content": "a.txt b.txt",
    }


def test_a_stop_sequence_and_the_output_cap_are_reported(stack: Stack) -> None:
    client = _client(stack.new_session())
    stopped = _ask(client, False, stop_sequences=["END"], messages=[_user("SAY:one END two")])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert stopped.content[0].text == "one "  # type: ignore[union-attr]
    capped = _ask(client, True, max_tokens=4, messages=[_user("SAY:a long answer")])
    assert capped.stop_reason == "max_tokens"


@pytest.mark.parametrize(
    "request_fields",
    [
        {"tools": [BASH], "tool_choice": {"type": "any"}},
        {"tools": [BASH], "tool_choice": {"type": "tool", "name": "bash"}},
        {
            "messages": [
                _user(
                    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]
                )
            ]
        },
    ],
)
def test_a_refused_request_raises_bad_request_and_spends_nothing(stack: Stack, request_fields: Any) -> None:
    session = stack.new_session(max_model_calls=1)
    client = _client(session)
    request = {"messages": [_user("SAY:hi")], **request_fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        _ask(client, False, **request)
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert stack.calls(session["session_id"]) == []
    assert _ask(client, False, messages=[_user("SAY:still here")]).content[0].text == "still here"  # type: ignore[union-attr]


def test_count_tokens_is_answered_without_a_journal_record(stack: Stack) -> None:
    session = stack.new_session()
    counted = _client(session).messages.count_tokens(
        model="claude-x", system="Be brief.", tools=[BASH], messages=[_user("how big is this?")]
    )
    assert counted.input_tokens > 1
    assert stack.calls(session["session_id"]) == [] and stack.engine.requests == []


def test_an_unknown_api_key_raises_authentication_error(stack: Stack) -> None:
    client = _client({"session_id": "no-such-session", "root_url": stack.url})
    with pytest.raises(anthropic.AuthenticationError):
        _ask(client, False, messages=[_user("hi")])


def test_a_spent_budget_answers_a_final_message_in_both_modes(stack: Stack) -> None:
    session = stack.new_session(max_model_calls=1)
    client = _client(session)
    _ask(client, False, messages=[_user("SAY:first")])
    for stream in (False, True):
        final = _ask(client, stream, tools=[BASH], messages=[_user("SAY:second")])
        assert final.stop_reason == "end_turn" and "budget" in final.content[0].text.lower()  # type: ignore[union-attr]


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
    with pytest.raises(anthropic.APIStatusError) as caught:
        _ask(_client(session), True, messages=[_user("SAY:never")])
    assert caught.value.response.headers["content-type"].startswith("text/event-stream")
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["type"] == "api_error" and "timed out" in error["message"]
