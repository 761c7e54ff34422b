"""Engine faults, bad agent input, budgets and concurrency, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from harness_trainer.trace import TrainingTrace
from tests.proxy.conftest import Stack

HELLO = {"model": "m", "messages": [{"role": "user", "content": "SAY:hello"}]}


def post(
    stack: Stack, session: dict[str, Any], body: Any, path: str = "/chat/completions", **kw: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {session['session_id']}", **kw.pop("headers", {})}
    return httpx.post(session["base_url"] + path, headers=headers, json=body, timeout=30, **kw)


def faults(stack: Stack, *queue: dict[str, Any]) -> None:
    httpx.post(stack.engine_url + "/_faults", json={"queue": list(queue)}).raise_for_status()


def test_engine_5xx_is_retried_and_the_call_succeeds(stack: Stack) -> None:
    session = stack.new_session()
    faults(stack, {"mode": "status", "status": 503}, {"mode": "status", "status": 500})
    response = post(stack, session, HELLO)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "hello"
    assert len(stack.engine.requests) == 3
    (call,) = stack.calls(session["session_id"])
    assert call["timings"]["attempts"] == 3


def test_retry_after_is_honoured(stack: Stack) -> None:
    session = stack.new_session()
    faults(stack, {"mode": "status", "status": 429, "retry_after": 0.6})
    started = time.monotonic()
    assert post(stack, session, HELLO).status_code == 200
    assert time.monotonic() - started >= 0.6


def test_an_engine_that_keeps_failing_gives_a_clear_502_and_refunds_the_budget(stack: Stack) -> None:
    session = stack.new_session(max_model_calls=1)
    faults(stack, *[{"mode": "status", "status": 500, "message": "engine exploded"}] * 3)
    response = post(stack, session, HELLO)
    assert response.status_code == 502
    assert (
        "3 attempts" in response.json()["error"]["message"]
        and "engine exploded" in response.json()["error"]["message"]
    )
    assert post(stack, session, HELLO).status_code == 200  # the failed call did not spend the budget
    kinds = [c["kind"] for c in stack.calls(session["session_id"])]
    assert kinds == ["upstream_error", "model"]


def test_an_anthropic_client_gets_the_502_in_its_own_shape(stack: Stack) -> None:
    session = stack.new_session()
    faults(stack, *[{"mode": "status", "status": 503}] * 3)
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    response = post(stack, session, body, path="/messages")
    assert response.status_code == 502
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "api_error"


def test_an_engine_timeout_and_a_mid_body_disconnect_are_retried(stack: Stack) -> None:
    stack.stop_proxy()
    stack.config_overrides["upstream_timeout_s"] = 0.5
    stack.start_proxy()
    session = stack.new_session()
    faults(stack, {"mode": "timeout", "seconds": 2}, {"mode": "disconnect"})
    response = post(stack, session, HELLO)
    assert response.status_code == 200
    (call,) = stack.calls(session["session_id"])
    assert call["timings"]["attempts"] == 3


def test_a_malformed_engine_reply_is_retried_then_a_502(stack: Stack) -> None:
    session = stack.new_session()
    faults(stack, {"mode": "malformed"})
    assert post(stack, session, HELLO).status_code == 200
    faults(stack, *[{"mode": "malformed"}] * 3)
    response = post(stack, session, HELLO)
    assert response.status_code == 502 and "not JSON" in response.json()["error"]["message"]


def test_an_engine_without_ids_makes_the_session_untrainable_said_clearly(stack: Stack) -> None:
    session = stack.new_session()
    faults(stack, {"mode": "no_ids"})
    assert post(stack, session, HELLO).status_code == 200
    trace = stack.admin.get(f"/sessions/{session['session_id']}/trace")
    assert trace.status_code == 409 and "token ids" in trace.json()["error"]["message"]
    summary = stack.admin.get(f"/sessions/{session['session_id']}").json()
    assert summary["trainable"] is False and summary["findings"][0]["code"] == "no_token_ids"


@pytest.mark.parametrize(
    ("mode", "code"), [("bad_pairing", "token_mismatch"), ("positive_logprob", "bad_logprobs")]
)
def test_a_reply_failing_the_pairing_check_is_returned_but_becomes_context_only(
    stack: Stack, mode: str, code: str
) -> None:
    session = stack.new_session()
    faults(stack, {"mode": mode})
    assert post(stack, session, HELLO).json()["choices"][0]["message"]["content"] == "hello"
    (turn,) = TrainingTrace.model_validate(stack.trace(session["session_id"])).turns
    assert set(turn.loss_mask) == {0} and turn.metadata["finding"]["code"] == code


def test_a_context_length_refusal_ends_the_episode_with_a_terminal_reply_and_a_finding(stack: Stack) -> None:
    session = stack.new_session()
    assert post(stack, session, HELLO).status_code == 200
    faults(stack, {"mode": "context_length"})
    response = post(stack, session, HELLO)
    assert response.status_code == 200
    assert "Context length exhausted" in response.json()["choices"][0]["message"]["content"]
    summary = stack.admin.get(f"/sessions/{session['session_id']}").json()
    assert [f["code"] for f in summary["findings"]] == ["context_exhausted"]
    assert len(stack.trace(session["session_id"])["turns"]) == 1


def test_the_budget_holds_under_concurrency_and_the_terminal_reply_is_never_trained(stack: Stack) -> None:
    session = stack.new_session(max_model_calls=5)

    async def burst() -> list[Any]:
        client = openai.AsyncOpenAI(
            base_url=session["base_url"], api_key=session["session_id"], max_retries=0
        )
        calls = [
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"SAY:n{i}"}])
            for i in range(20)
        ]
        try:
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    replies = asyncio.run(burst())
    texts = [r.choices[0].message.content for r in replies]
    assert sum(t.startswith("Step budget exhausted") for t in texts) == 15
    assert len(stack.engine.requests) == 5
    calls = stack.calls(session["session_id"])
    assert sorted(c["seq"] for c in calls) == list(range(20))
    assert len(stack.trace(session["session_id"])["turns"]) == 5
    assert stack.admin.get(f"/sessions/{session['session_id']}").json()["status"] == "budget_exhausted"


def test_concurrent_calls_on_one_session_keep_the_journal_consistent(stack: Stack) -> None:
    session = stack.new_session()

    async def burst() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            headers = {"Authorization": f"Bearer {session['session_id']}"}
            body = lambda i: {"model": "m", "messages": [{"role": "user", "content": f"SAY:{'x' * i}"}]}  # noqa: E731
            await asyncio.gather(
                *[
                    client.post(session["base_url"] + "/chat/completions", headers=headers, json=body(i))
                    for i in range(40)
                ]
            )

    asyncio.run(burst())
    calls = stack.calls(session["session_id"])
    assert [c["seq"] for c in calls] == list(range(40))
    assert len({c["call_id"] for c in calls}) == 40
    trace = TrainingTrace.model_validate(stack.trace(session["session_id"]))
    assert len(trace.turns) == 40


def test_an_agent_that_disconnects_mid_call_is_journaled_once(stack: Stack) -> None:
    session = stack.new_session()
    faults(stack, {"mode": "delay", "seconds": 0.5})
    raw = httpx.Request(
        "POST",
        session["base_url"] + "/chat/completions",
        json=HELLO,
        headers={"Authorization": f"Bearer {session['session_id']}"},
    )
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST {raw.url.raw_path.decode()} HTTP/1.1\r\nHost: {host}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in raw.headers.items() if k.lower() != "host") + "\r\n"
        sock.sendall(head.encode() + raw.read())
        time.sleep(0.1)
    assert len(stack.settled_calls(session["session_id"])) == 1
    assert stack.state.inflight == 0


def test_invalid_json_is_a_400_with_the_reason(stack: Stack) -> None:
    session = stack.new_session()
    response = httpx.post(
        session["base_url"] + "/chat/completions",
        content=b"{nope",
        headers={"Authorization": f"Bearer {session['session_id']}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_an_oversized_body_is_a_413(stack: Stack) -> None:
    stack.stop_proxy()
    stack.config_overrides["max_body_bytes"] = 10_000
    stack.start_proxy()
    session = stack.new_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}
    response = post(stack, session, body)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    assert stack.engine.requests == []


def test_a_reply_that_fails_to_render_is_a_500_and_the_journal_stays_in_order(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capture_proxy.dialects.chat import DIALECT

    session = stack.new_session()

    def broken(*args: Any) -> Any:
        raise RuntimeError("render bug")

    with monkeypatch.context() as patch:
        patch.setattr(DIALECT, "render_reply", broken)
        assert post(stack, session, HELLO).status_code == 500
    assert post(stack, session, HELLO).status_code == 200
    calls = stack.calls(session["session_id"])
    assert [c["seq"] for c in calls] == [0, 1] and [c["kind"] for c in calls] == ["model", "model"]
