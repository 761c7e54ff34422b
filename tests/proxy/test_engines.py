"""A session's own engine: allowed engines only, its served model, its credential, kept over a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.proxy.conftest import Stack
from tests.proxy.fake_engine import FakeEngine, ServerThread
from tests.proxy.test_admin import call


@pytest.fixture
def second_engine(servers: ServerThread) -> Iterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    yield engine, servers.serve(engine.app())


@pytest.fixture
def two_engine_stack(
    servers: ServerThread, tmp_path: Path, second_engine: tuple[FakeEngine, str]
) -> Iterator[Stack]:
    stack = Stack(servers, tmp_path / "data", allowed_upstreams=(second_engine[1] + "/v1/",))
    yield stack
    stack.close()
    for runner in list(servers.runners):
        servers.stop_runner(runner)


def test_a_session_naming_an_allowed_engine_reaches_it_with_its_model_and_credential(
    two_engine_stack: Stack, second_engine: tuple[FakeEngine, str]
) -> None:
    engine, url = second_engine
    spec = {"upstream": url, "model": "served-b", "engine_headers": {"Authorization": "Bearer engine-key"}}
    session = two_engine_stack.new_session(**spec)
    default = two_engine_stack.new_session()

    assert call(session).status_code == 200
    assert call(default).status_code == 200

    assert [body["model"] for body in engine.requests] == ["served-b"]
    assert engine.authorizations == [{"Authorization": "Bearer engine-key"}]
    assert len(two_engine_stack.engine.requests) == 1  # the default session's call only
    assert "Authorization" not in two_engine_stack.engine.authorizations[0]

    summary = two_engine_stack.admin.get(f"/sessions/{session['session_id']}").json()
    assert summary["upstream"] == url and summary["model"] == "served-b"
    assert "engine-key" not in two_engine_stack.admin.get("/sessions").text  # never handed back


def test_an_engine_not_allowed_is_a_400_naming_the_allowed_ones(two_engine_stack: Stack) -> None:
    response = two_engine_stack.admin.post("/sessions", json={"upstream": "http://169.254.169.254:80"})

    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "169.254.169.254" in message and two_engine_stack.engine_url in message
    assert two_engine_stack.admin.get("/sessions").json()["sessions"] == []


def test_a_header_with_a_line_break_is_refused(two_engine_stack: Stack) -> None:
    bad = {"engine_headers": {"X-Key": "a\r\nHost: evil"}}
    assert two_engine_stack.admin.post("/sessions", json=bad).status_code == 400
    assert two_engine_stack.admin.post("/sessions", json={"engine_headers": {"a b": "x"}}).status_code == 400


def test_a_restarted_proxy_keeps_each_sessions_engine_model_and_credential(
    two_engine_stack: Stack, second_engine: tuple[FakeEngine, str]
) -> None:
    engine, url = second_engine
    spec = {"upstream": url, "model": "served-b", "engine_headers": {"X-Api-Key": "k2"}}
    session = two_engine_stack.new_session(**spec)
    two_engine_stack.stop_proxy()
    two_engine_stack.start_proxy()
    session = {**session, "base_url": two_engine_stack.url + "/v1"}

    assert call(session).status_code == 200
    assert engine.requests[-1]["model"] == "served-b"
    assert engine.authorizations[-1] == {"X-Api-Key": "k2"}


def test_the_policy_moves_sessions_on_every_engine(
    two_engine_stack: Stack, second_engine: tuple[FakeEngine, str]
) -> None:
    engine, url = second_engine
    session = two_engine_stack.new_session(upstream=url, model="served-b")
    two_engine_stack.admin.put("/policy", json={"model": "adapter-v2", "version": 2})

    assert call(session).status_code == 200
    assert engine.requests[-1]["model"] == "adapter-v2"
    assert httpx.get(url + "/_requests").json()[-1]["model"] == "adapter-v2"
