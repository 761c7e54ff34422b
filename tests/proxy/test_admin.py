"""Admin routes, session isolation, metrics and keepalives."""

from __future__ import annotations

import base64
import re
import time
from contextlib import AbstractContextManager

import httpx
import pytest

from capture_proxy.config import ConfigError, ProxyConfig
from tests.proxy.conftest import Stack

HELLO = {"model": "m", "messages": [{"role": "user", "content": "SAY:hello"}]}


def call(session: dict[str, str], body: dict | None = None, **kw: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {session['session_id']}"}
    return httpx.post(session["base_url"] + "/chat/completions", headers=headers, json=body or HELLO, **kw)


@pytest.mark.parametrize("route", ["/sessions", "/sessions/x", "/sessions/x/trace", "/sessions/x/calls"])
def test_admin_routes_need_the_admin_key(stack: Stack, route: str) -> None:
    assert httpx.get(stack.url + route).status_code == 401
    assert httpx.get(stack.url + route, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_a_session_key_cannot_read_or_delete_sessions(stack: Stack) -> None:
    a, b = stack.new_session(), stack.new_session()
    assert call(a).status_code == 200
    for method, route in [
        ("GET", f"/sessions/{a['session_id']}/calls"),
        ("DELETE", f"/sessions/{a['session_id']}"),
    ]:
        response = httpx.request(
            method, stack.url + route, headers={"Authorization": f"Bearer {b['session_id']}"}
        )
        assert response.status_code == 401
    assert stack.calls(b["session_id"]) == []
    assert len(stack.calls(a["session_id"])) == 1


def test_session_ids_are_at_least_128_random_bits(stack: Stack) -> None:
    ids = {stack.new_session()["session_id"] for _ in range(20)}
    assert len(ids) == 20
    for session_id in ids:
        assert session_id.startswith("cs_")
        token = session_id.removeprefix("cs_")
        assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) * 8 >= 128


def test_a_bad_session_spec_is_a_400_that_names_the_field(stack: Stack) -> None:
    response = stack.admin.post("/sessions", json={"sampling": {"top_p": 0.9}})
    assert response.status_code == 400 and "top_p" in response.json()["error"]["message"]
    response = stack.admin.post("/sessions", json={"max_model_calls": 0})
    assert response.status_code == 400 and "max_model_calls" in response.json()["error"]["message"]
    assert stack.admin.post("/sessions", content=b"{x").status_code == 400


def test_list_get_and_delete_a_session(stack: Stack) -> None:
    session = stack.new_session(metadata={"episode": 7})
    listed = stack.admin.get("/sessions").json()["sessions"]
    assert [s["session_id"] for s in listed] == [session["session_id"]]
    assert stack.admin.get(f"/sessions/{session['session_id']}").json()["metadata"] == {"episode": 7}
    assert stack.admin.delete(f"/sessions/{session['session_id']}").status_code == 200
    assert stack.admin.get(f"/sessions/{session['session_id']}").status_code == 404
    assert call(session).status_code == 401
    assert not (stack.data_dir / "sessions" / session["session_id"]).exists()


def test_a_session_without_calls_has_no_trace(stack: Stack) -> None:
    session = stack.new_session()
    response = stack.admin.get(f"/sessions/{session['session_id']}/trace")
    assert response.status_code == 409 and "no model calls" in response.json()["error"]["message"]


def test_count_tokens_is_answered_locally_and_never_journaled(stack: Stack) -> None:
    session = stack.new_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    response = httpx.post(
        stack.url + "/v1/messages/count_tokens", headers={"x-api-key": session["session_id"]}, json=body
    )
    assert response.status_code == 200 and response.json()["input_tokens"] >= 1
    assert stack.engine.requests == [] and stack.calls(session["session_id"]) == []


def test_metrics_count_requests_errors_latency_sessions_and_journal_bytes(stack: Stack) -> None:
    session = stack.new_session()
    assert call(session).status_code == 200
    assert httpx.post(stack.url + "/v1/chat/completions", json=HELLO).status_code == 401
    text = httpx.get(stack.url + "/metrics").text
    assert 'capture_proxy_requests_total{route="/v1/chat/completions",status="200"} 1' in text
    assert 'capture_proxy_errors_total{kind="bad_request"} 1' in text
    assert "capture_proxy_upstream_seconds_count 1" in text and "capture_proxy_added_seconds_count 1" in text
    assert "capture_proxy_open_sessions 1" in text
    match = re.search(r"^capture_proxy_journal_bytes_total (\d+)$", text, re.MULTILINE)
    assert match is not None
    journal_bytes = int(match.group(1))
    journal = (stack.data_dir / "sessions" / session["session_id"] / "calls.jsonl").read_bytes()
    assert journal_bytes == len(journal)  # beside the write-ahead log a journal keeps no zeroed reserve


def slow_streaming_session(stack: Stack, keepalive_s: float, engine_delay_s: float) -> dict[str, str]:
    """A new session on a proxy restarted with ``keepalive_s``, its engine holding the next reply."""
    stack.stop_proxy()
    stack.config_overrides["keepalive_s"] = keepalive_s
    stack.start_proxy()
    session = stack.new_session()
    httpx.post(stack.engine_url + "/_faults", json={"queue": [{"mode": "delay", "seconds": engine_delay_s}]})
    return session


def stream(session: dict[str, str]) -> AbstractContextManager[httpx.Response]:
    headers = {"Authorization": f"Bearer {session['session_id']}"}
    url = session["base_url"] + "/chat/completions"
    return httpx.stream("POST", url, json={**HELLO, "stream": True}, headers=headers, timeout=30)


def test_a_slow_engine_gives_a_streaming_client_keepalive_comments(stack: Stack) -> None:
    session = slow_streaming_session(stack, keepalive_s=0.2, engine_delay_s=1.0)
    started = time.monotonic()
    lines, first_line_at = [], None
    with stream(session) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            first_line_at = first_line_at or time.monotonic() - started
            lines.append(line)
    assert first_line_at is not None and first_line_at < 0.9
    assert lines.count(": keepalive") >= 2 and [line for line in lines if line][-1] == "data: [DONE]"


def test_a_streaming_agent_gone_during_keepalives_is_journaled_once_and_leaves_nothing(stack: Stack) -> None:
    session = slow_streaming_session(stack, keepalive_s=0.1, engine_delay_s=0.8)
    with stream(session) as response:
        assert next(response.iter_lines()) == ": keepalive"
    assert len(stack.settled_calls(session["session_id"])) == 1
    assert stack.state.inflight == 0
    assert stack.admin.get(f"/sessions/{session['session_id']}").json()["model_calls"] == 1
    follow_up = call(session, {**HELLO, "stream": True}, timeout=30)
    assert follow_up.status_code == 200 and follow_up.text.rstrip().endswith("data: [DONE]")
    assert len(stack.calls(session["session_id"])) == 2


def test_binding_a_public_address_without_an_admin_key_is_refused(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CAPTURE_PROXY_ADMIN_KEY", raising=False)
    with pytest.raises(ConfigError, match="admin key"):
        ProxyConfig(upstream="http://127.0.0.1:1", data_dir=tmp_path, host="0.0.0.0").resolved()  # type: ignore[arg-type]
    monkeypatch.setenv("CAPTURE_PROXY_ADMIN_KEY", "k")
    assert ProxyConfig(upstream="http://x", data_dir=tmp_path, host="0.0.0.0").resolved().admin_key == "k"  # type: ignore[arg-type]


def upstream(stack: Stack, sent: int, timeout_s: float = 10.0) -> None:
    """Wait until the engine has received a request beyond the first ``sent``: the call is in flight
    upstream (a fixed sleep is not enough on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while len(stack.engine.requests) <= sent:
        assert time.monotonic() < deadline, "the call never reached the engine"
        time.sleep(0.01)


def test_deleting_a_session_while_a_call_is_in_flight_loses_nothing_else_and_leaks_nothing(
    stack: Stack,
) -> None:
    import threading

    session = stack.new_session()
    httpx.post(stack.engine_url + "/_faults", json={"queue": [{"mode": "delay", "seconds": 0.5}]})
    answers: list[httpx.Response] = []
    sent = len(stack.engine.requests)
    worker = threading.Thread(target=lambda: answers.append(call(session, timeout=30)))
    worker.start()
    upstream(stack, sent)
    assert stack.admin.delete(f"/sessions/{session['session_id']}").status_code == 200
    worker.join(10)
    assert answers[0].status_code == 200  # the agent still gets the reply it was waiting for
    assert not (stack.data_dir / "sessions" / session["session_id"]).exists()
    assert stack.state.inflight == 0
    assert call(session).status_code == 401


def test_a_policy_sends_every_later_call_to_its_model_and_records_its_version(stack: Stack) -> None:
    session = stack.new_session()
    stack.engine.weight_version = None  # vLLM's replies carry no version: the policy's is recorded
    assert call(session).status_code == 200
    put = stack.admin.put("/policy", json={"model": "policy-v3", "version": 3})
    assert put.status_code == 200 and put.json() == {"policy": {"model": "policy-v3", "version": 3}}
    assert call(session).status_code == 200

    assert [body["model"] for body in stack.engine.requests][-1] == "policy-v3"
    assert stack.engine.requests[-2]["model"] != "policy-v3"
    assert [c["weight_version"] for c in stack.calls(session["session_id"])] == [None, 3]
    assert stack.admin.get("/policy").json() == {"policy": {"model": "policy-v3", "version": 3}}

    stack.engine.weight_version = 4  # an engine that names its own version wins
    assert call(session).status_code == 200
    assert stack.calls(session["session_id"])[-1]["weight_version"] == 4
    assert stack.admin.delete("/policy").json() == {"policy": None}
    assert call(session).status_code == 200 and stack.engine.requests[-1]["model"] != "policy-v3"


def test_a_version_only_policy_stamps_dispatch_and_return_versions_and_keeps_the_model(stack: Stack) -> None:
    import threading

    session = stack.new_session()
    stack.engine.weight_version = None
    assert call(session).status_code == 200
    model = stack.engine.requests[-1]["model"]
    put = stack.admin.put("/policy", json={"version": 1})
    assert put.status_code == 200 and put.json() == {"policy": {"model": None, "version": 1}}
    assert call(session).status_code == 200
    assert stack.engine.requests[-1]["model"] == model  # no served model named: the call keeps its own

    # A push lands while a call is upstream: sent at version 1, answered at version 2.
    httpx.post(stack.engine_url + "/_faults", json={"queue": [{"mode": "delay", "seconds": 0.5}]})
    answers: list[httpx.Response] = []
    sent = len(stack.engine.requests)
    worker = threading.Thread(target=lambda: answers.append(call(session, timeout=30)))
    worker.start()
    upstream(stack, sent)
    assert stack.admin.put("/policy", json={"version": 2}).status_code == 200
    worker.join(10)
    assert answers[0].status_code == 200

    calls = stack.calls(session["session_id"])
    assert [(c["dispatch_version"], c["weight_version"]) for c in calls] == [(None, None), (1, 1), (1, 2)]
    stack.engine.weight_version = 7  # an engine that names its own version wins for the return side only
    assert call(session).status_code == 200
    last = stack.calls(session["session_id"])[-1]
    assert (last["dispatch_version"], last["weight_version"]) == (2, 7)


def test_a_bad_policy_is_a_400_naming_the_field_and_needs_the_admin_key(stack: Stack) -> None:
    response = stack.admin.put("/policy", json={"model": "", "version": -1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "model" in message and "version" in message
    assert stack.admin.put("/policy", json={"model": "m", "version": 1, "x": 1}).status_code == 400
    assert httpx.put(stack.url + "/policy", json={"model": "m", "version": 1}).status_code == 401
    assert stack.admin.get("/policy").json() == {"policy": None}
