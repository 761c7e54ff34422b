"""OpenAI Chat Completions through the proxy, with the official ``openai`` SDK as the agent."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from harness_trainer.trace import TrainingTrace
from tests.proxy.conftest import Stack

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def client_for(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["session_id"], max_retries=0)


def tool_turns(client: openai.OpenAI, stream: bool) -> list[Any]:
    """Two turns: the engine calls bash, the agent sends the result back, the engine answers."""
    messages: list[Any] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": 'CALL:bash:{"command": "ls"}'},
    ]
    first = client.chat.completions.create(model="agent-model", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "SAY:all done"}]
    if not stream:
        second = client.chat.completions.create(model="agent-model", messages=messages, tools=TOOLS)
        return [first, second]
    chunks = list(
        client.chat.completions.create(model="agent-model", messages=messages, tools=TOOLS, stream=True)
    )
    return [first, chunks]


def test_a_tool_call_round_trips_and_the_trace_is_one_chain(stack: Stack) -> None:
    session = stack.new_session(sampling={"temperature": 0.5})
    first, second = tool_turns(client_for(session), stream=False)
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(first.choices[0].message.tool_calls[0].function.arguments) == {"command": "ls"}
    assert second.choices[0].message.content == "all done"
    assert first.model == "agent-model"
    trace = TrainingTrace.model_validate(stack.trace(session["session_id"]))
    a, b = trace.turns
    assert b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.completion_token_ids)] == (
        a.prompt_token_ids + a.completion_token_ids
    )
    assert b.metadata["parent"] == a.node_id
    assert a.loss_mask == [0] * len(a.prompt_token_ids) + [1] * len(a.completion_token_ids)


def test_the_engine_ids_and_logprobs_never_reach_the_agent(stack: Stack) -> None:
    session = stack.new_session()
    response = httpx.post(
        session["base_url"] + "/chat/completions",
        headers={"Authorization": f"Bearer {session['session_id']}"},
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
    )
    body = response.json()
    assert response.status_code == 200
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None


def test_a_stream_replays_content_and_tool_calls_as_chunks(stack: Stack) -> None:
    session = stack.new_session()
    client = client_for(session)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": 'CALL:bash:{"command": "pwd"}'}],
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas if d.tool_calls)
    assert json.loads(arguments) == {"command": "pwd"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    _, streamed = tool_turns(client, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "all done"


def test_the_session_policy_overrides_the_agent_and_both_are_recorded(stack: Stack) -> None:
    session = stack.new_session(sampling={"temperature": 0.25, "max_tokens": 500})
    client_for(session).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        temperature=1.7,
        top_p=0.3,
        presence_penalty=0.5,
        max_completion_tokens=900,
    )
    sent = stack.engine.requests[-1]
    assert sent["temperature"] == 0.25 and sent["top_p"] == 1.0 and "presence_penalty" not in sent
    assert sent["max_tokens"] == 500 and sent["model"] == "fake-model"
    assert sent["logprobs"] is True and sent["top_logprobs"] == 0 and sent["n"] == 1
    assert sent["return_token_ids"] is True and sent["return_tokens_as_token_ids"] is True
    assert sent["stream"] is False
    (call,) = stack.calls(session["session_id"])
    assert call["agent_params"]["temperature"] == 1.7 and call["agent_params"]["top_p"] == 0.3
    assert call["sampling"]["temperature"] == 0.25


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": {"12": 5}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "bash"}}},
        {"min_tokens": 5},
        {"guided_regex": "a+"},
    ],
)
def test_constrained_decoding_is_refused_before_any_budget_is_spent(
    stack: Stack, extra: dict[str, Any]
) -> None:
    session = stack.new_session(max_model_calls=1)
    client = client_for(session)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, extra_body=extra
        )
    assert "constrained" in str(info.value) or "forces a tool call" in str(info.value)
    assert stack.engine.requests == []
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "SAY:x"}])
    assert reply.choices[0].message.content == "x"


def test_the_session_id_works_as_x_api_key_and_as_a_path_prefix(stack: Stack) -> None:
    session = stack.new_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "SAY:yes"}]}
    by_header = httpx.post(
        stack.url + "/v1/chat/completions", headers={"x-api-key": session["session_id"]}, json=body
    )
    by_path = httpx.post(
        session["prefixed_base_url"] + "/chat/completions",
        headers={"Authorization": "Bearer gateway"},
        json=body,
    )
    assert by_header.status_code == by_path.status_code == 200
    assert len(stack.calls(session["session_id"])) == 2


def test_an_unknown_or_missing_key_is_401_in_the_route_dialect(stack: Stack) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    missing = httpx.post(stack.url + "/v1/chat/completions", json=body)
    unknown = httpx.post(stack.url + "/v1/messages", headers={"x-api-key": "nope"}, json=body)
    assert missing.status_code == unknown.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert unknown.json()["type"] == "error" and unknown.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )


def test_models_lists_the_served_model(stack: Stack) -> None:
    session = stack.new_session()
    assert [m.id for m in client_for(session).models.list()] == ["fake-model"]
