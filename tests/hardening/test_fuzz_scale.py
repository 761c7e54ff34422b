"""Fuzzing at scale: more than 10,000 generated requests against the capture proxy and the rollout server.

Random methods, paths (known routes with good, deleted and nonsense ids), auth headers, and bodies (random
JSON, the right shape with wrong types, huge numbers, deep nesting, invalid UTF-8, non-JSON). Every answer
must be below 500 and every rejection a 4xx with a clear message (``error.message`` in JSON errors); the
one 5xx allowed is the proxy's 502 for a call the engine really received and failed (counted by the
engine itself). Both servers stay healthy, every session a test mints is deleted, and no session is left
open at the end. Strategies for chat-shaped bodies come from :mod:`tests.proxy.test_fuzz`.

Examples are derandomized (the same inputs every run, so CI is deterministic); each example sends a batch
of requests, counted; each test checks it sent its quota, and the quotas add up to more than 10,000.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_proxy.app import build_app
from capture_proxy.config import ProxyConfig
from harness_trainer.net import free_port
from harness_trainer.rollouts.server.routes import RolloutServer
from harness_trainer.rollouts.server.runtime import RuntimeConfig
from harness_trainer.tasks.sources import LocalTaskSource
from tests.hardening.fakes import IdleRuntime
from tests.proxy.fake_engine import FakeEngine, ServerThread
from tests.proxy.test_fuzz import chat_like, json_values
from tests.rollouts.conftest import EXAMPLES

pytestmark = pytest.mark.slow

ADMIN_KEY = "fuzz-admin-key-0123456789abcdef"
# requests each test must send (it sends a fixed batch per example, for a few more examples than needed)
QUOTAS = {
    "proxy_bodies": 2600,  # 12 per example
    "proxy_raw": 2000,  # 10 per example
    "proxy_routes": 2300,  # 6 per example
    "rollout_bodies": 1800,  # 9 per example
    "rollout_routes": 1600,  # 5 per example
}


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


class CountingEngine(FakeEngine):
    """The proxy tests' fake engine, counting the 5xx answers it gives (a crash included)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                self.failures += exc.status >= 500
                raise
            except Exception:
                self.failures += 1
                raise
            self.failures += response.status >= 500
            return response

        app.middlewares.append(count)
        return app


@dataclass
class Targets:
    servers: ServerThread
    engine: CountingEngine
    proxy: str
    rollout: str
    client: httpx.Client
    session_id: str
    """A capture session every agent-route example may use."""
    deleted_id: str
    """A capture session deleted at the start: its key must be as good as none."""
    sent: dict[str, int] = field(default_factory=dict)
    minted: list[str] = field(default_factory=list)

    def send(self, quota: str, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One request, counted under ``quota`` and checked: no 5xx of our own, clear rejections."""
        failures = self.engine.failures
        response = self.client.request(method, url, **kwargs)
        self.sent[quota] = self.sent.get(quota, 0) + 1
        check(response, engine_failed=self.engine.failures > failures)
        return response

    def healthy(self) -> None:
        assert self.client.get(self.proxy + "/health").status_code == 200
        assert self.client.get(self.rollout + "/health").status_code == 200


def check(response: httpx.Response, *, engine_failed: bool) -> None:
    status, text = response.status_code, response.text
    where = f"{response.request.method} {response.request.url}"
    if status == 502 and engine_failed:
        assert "engine" in text, (where, text)
        return
    assert status < 500, (where, status, text[:2000])
    if status >= 400:
        assert text.strip(), (where, status, "an empty error body")
        if response.headers.get("content-type", "").startswith("application/json"):
            message = response.json()["error"]["message"]
            assert isinstance(message, str) and message.strip(), (where, text)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    """A counting fake engine, a capture proxy on it, and a rollout server (idle runtime, the example
    tasks), all on loopback; at the end, every session minted is gone."""
    data = Path(tmp_path_factory.mktemp("fuzz-scale"))
    servers = ServerThread()
    client = httpx.Client(timeout=30)
    try:
        engine = CountingEngine()
        engine_url = servers.serve(engine.app())
        port = free_port()
        config = ProxyConfig(
            upstream=engine_url,
            data_dir=data / "capture",
            admin_key=ADMIN_KEY,
            port=port,
            retry_backoff_s=0.01,
        )
        proxy = servers.serve(build_app(config), port)
        runtime = IdleRuntime(
            RuntimeConfig(upstream=engine_url, data_dir=data / "rollouts", served_model="m")
        )
        rollout = servers.serve(
            RolloutServer(runtime, LocalTaskSource(EXAMPLES), max_concurrent_envs=6).app()
        )
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        session_id = client.post(proxy + "/sessions", headers=admin, json={"max_model_calls": 3}).json()[
            "session_id"
        ]
        deleted_id = client.post(proxy + "/sessions", headers=admin, json={}).json()["session_id"]
        assert client.delete(f"{proxy}/sessions/{deleted_id}", headers=admin).status_code == 200
        made = Targets(servers, engine, proxy, rollout, client, session_id, deleted_id)
        yield made
        made.healthy()
        assert client.delete(f"{proxy}/sessions/{session_id}", headers=admin).status_code == 200
        assert client.get(proxy + "/sessions", headers=admin).json()["sessions"] == [], (
            "capture sessions left"
        )
        assert client.get(rollout + "/health").json()["sessions"] == 0, "rollout sessions left"
    finally:
        client.close()
        servers.close()


def test_the_quotas_add_up_to_more_than_10000_requests() -> None:
    """The tests below each send at least their quota (they check it); together that is > 10,000."""
    assert sum(QUOTAS.values()) >= 10_000


# ------------------------------------------------------------------------------------- strategies


# keys as an agent or a stranger might present them
def key_choices(t: Targets) -> st.SearchStrategy[str]:
    return st.sampled_from([t.session_id, t.deleted_id, ADMIN_KEY, "", "cs_", t.session_id[:-1]]) | st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=50
    )


def auth_headers(t: Targets) -> st.SearchStrategy[dict[str, str]]:
    key = key_choices(t)
    return st.one_of(
        st.just({}),
        key.map(lambda k: {"Authorization": f"Bearer {k}".strip()}),
        key.map(lambda k: {"x-api-key": k} if k else {}),
        st.tuples(key, key).map(lambda ks: {"Authorization": f"Bearer {ks[0]}".strip(), "x-api-key": ks[1]}),
        st.sampled_from(
            ["Basic Zm9vOmJhcg==", "Bearer", "bearer " + ADMIN_KEY, "Token x", "Bearer a b c"]
        ).map(lambda v: {"Authorization": v}),
    )


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


# bodies that break parsers: huge numbers, deep nesting, invalid UTF-8, truncation, not JSON at all
NASTY = st.one_of(
    st.binary(max_size=200),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 5000).map(nested),
    st.integers(1, 5000).map(lambda n: b"[" * n),
    st.sampled_from(
        [b"1e999", b"-1e999", b"9" * 400, b"NaN", b"Infinity", b'{"a": 1e400}', b"\xef\xbb\xbf{}"]
    ),
    st.sampled_from([b'{"a": "\xff\xfe"}', b'{"\xc3\x28": 1}', b'{"a": "\\ud800"}', b"\x00", b"", b"null"]),
    st.sampled_from([b'{"messages": [', b'{"model": "m",', b"[]", b'"str"', b"true", b"{}"]),
    json_values.map(lambda v: json.dumps(v).encode()),
)
big_numbers = st.sampled_from([2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, 2**53 + 1])
wrong_types = st.one_of(
    st.none(), st.booleans(), big_numbers, st.integers(-3, 3), st.text(max_size=10),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)  # fmt: skip


def session_specs() -> st.SearchStrategy[dict[str, Any]]:
    """``POST /sessions`` bodies of the right shape with right and wrong types."""
    sampling = st.fixed_dictionaries(
        {},
        optional={"temperature": st.floats(0, 2) | wrong_types, "top_p": wrong_types, "top_k": wrong_types},
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "sampling": sampling | wrong_types,
            "max_model_calls": st.integers(-2, 5) | wrong_types,
            "metadata": st.dictionaries(st.text(max_size=5), json_values, max_size=3) | wrong_types,
            "bogus": json_values,
        },
    )


def rollout_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """``POST /sessions/{id}/rollout`` bodies: the right keys with right and wrong values."""
    return st.fixed_dictionaries(
        {},
        optional={
            "split": st.sampled_from(["train", "test", "", "nope"]) | wrong_types,
            "index": st.integers(-2, 8) | wrong_types | st.sampled_from(["0", "1", "x", "1e3"]),
            "instruction": st.text(max_size=30) | wrong_types,
            "harness": st.sampled_from(["toy", "opencode", "nope"]) | wrong_types,
            "sandbox": st.sampled_from(["local", "e2b"]) | wrong_types,
            "sampling": st.none()
            | st.dictionaries(st.text(max_size=5), json_values, max_size=2)
            | wrong_types,
            "agent_timeout_sec": st.floats(allow_nan=True) | wrong_types,
            "agent_step_limit": wrong_types,
            "seed": wrong_types,
            "episode_id": wrong_types,
            "reward_key": wrong_types,
            "unknown": json_values,
        },
    )


path_text = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"), max_size=40
)
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


def ids(t: Targets) -> st.SearchStrategy[str]:
    return st.sampled_from(
        [t.session_id, t.deleted_id, "x", "..", "%2e%2e", "a" * 300, "cs_" + "A" * 43]
    ) | st.text(alphabet=st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=30)


PROXY_ROUTES = [
    "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/models",
    "/s/{id}/v1/chat/completions", "/s/{id}/v1/messages", "/s/{id}/v1/responses", "/s/{id}/v1/models",
    "/s/{id}/v1/messages/count_tokens", "/sessions", "/sessions/{id}", "/sessions/{id}/trace",
    "/sessions/{id}/calls", "/health", "/metrics", "/", "/v1", "/s/{id}", "/sessions/{id}/x",
]  # fmt: skip
ROLLOUT_ROUTES = [
    "/health", "/splits", "/splits/{id}/tasks", "/splits/train/tasks", "/sessions", "/sessions/{id}",
    "/sessions/{id}/rollout", "/sessions/{id}/stop", "/sessions/{id}/trace", "/sessions/{id}?wait={q}", "/",
]  # fmt: skip
MODEL_ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"]


def close_opened(t: Targets, response: httpx.Response) -> None:
    """A 201 from the rollout server's ``POST /sessions`` is a slot the fuzz must give back."""
    if response.status_code == 201 and response.request.url.path == "/sessions":
        closed = t.client.delete(f"{t.rollout}/sessions/{response.json()['session_id']}")
        assert closed.status_code == 200, closed.text


def delete_minted(t: Targets, response: httpx.Response) -> None:
    """A 201 from an admin mint is a session the fuzz must clean up."""
    if response.status_code == 201 and response.request.url.path == "/sessions":
        session_id = response.json()["session_id"]
        t.minted.append(session_id)
        assert t.client.delete(
            f"{t.proxy}/sessions/{session_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )


# ---------------------------------------------------------------------------------- the capture proxy


def test_proxy_agent_routes_with_generated_bodies_and_keys(targets: Targets) -> None:
    """Chat/Anthropic/Responses-shaped nonsense, under every auth variant, on every model route, bare and
    path-prefixed: never a 5xx of the proxy's own, rejections are 4xx with a message."""
    t = targets

    @fuzz(220)
    @given(body=chat_like, headers=auth_headers(t), stream=st.booleans(), prefixed=st.booleans())
    def run(body: dict[str, Any], headers: dict[str, str], stream: bool, prefixed: bool) -> None:
        if stream:
            body = {**body, "stream": True}
        for route in MODEL_ROUTES:
            url = f"{t.proxy}/s/{t.session_id}{route}" if prefixed else t.proxy + route
            t.send("proxy_bodies", "POST", url, json=body, headers=headers)
        for route in MODEL_ROUTES[:2]:
            t.send("proxy_bodies", "POST", t.proxy + route, json=body, headers={"x-api-key": t.deleted_id})
        t.send("proxy_bodies", "POST", t.proxy + "/v1/chat/completions", json=body, headers=headers)
        t.send("proxy_bodies", "POST", t.proxy + "/v1/messages", json=body, headers=headers)
        t.send("proxy_bodies", "POST", t.proxy + "/v1/responses", json=body, headers=headers)
        t.send(
            "proxy_bodies", "POST", t.proxy + "/sessions", json=body, headers={"Authorization": "Bearer x"}
        )
        t.send("proxy_bodies", "POST", t.proxy + "/v1/models", json=body, headers=headers)
        t.send("proxy_bodies", "GET", t.proxy + "/v1/models", headers=headers)

    run()
    t.healthy()
    assert t.sent["proxy_bodies"] >= QUOTAS["proxy_bodies"], t.sent


def test_proxy_routes_with_raw_and_malformed_bodies(targets: Targets) -> None:
    """Invalid UTF-8, deep nesting, huge numbers, truncated and non-JSON bodies on every POST route
    (agent routes with a valid key, the admin mint with the admin key): 400/413-style answers, never 5xx;
    a valid mint is cleaned up."""
    t = targets
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    agent = {"Authorization": f"Bearer {t.session_id}", "Content-Type": "application/json"}

    @fuzz(220)
    @given(
        raw=NASTY,
        content_type=st.sampled_from(
            ["application/json", "text/plain", "", "application/x-www-form-urlencoded"]
        ),
    )
    def run(raw: bytes, content_type: str) -> None:
        for route in MODEL_ROUTES:
            t.send(
                "proxy_raw",
                "POST",
                t.proxy + route,
                content=raw,
                headers={**agent, "Content-Type": content_type},
            )
            t.send("proxy_raw", "POST", f"{t.proxy}/s/{t.session_id}{route}", content=raw)
        delete_minted(t, t.send("proxy_raw", "POST", t.proxy + "/sessions", content=raw, headers=admin))
        t.send("proxy_raw", "POST", t.proxy + "/sessions", content=raw)

    run()
    t.healthy()
    assert t.sent["proxy_raw"] >= QUOTAS["proxy_raw"], t.sent


def test_proxy_admin_and_unknown_routes_with_random_methods_ids_and_keys(targets: Targets) -> None:
    """Random methods on known routes with good, deleted and nonsense ids, random paths, random auth, and
    session specs of the right shape with wrong types: never a 5xx; every session minted is deleted; the
    fuzz never reads or deletes the standing session without the admin key."""
    t = targets
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    @fuzz(400)
    @given(
        method=st.sampled_from(METHODS),
        route=st.sampled_from(PROXY_ROUTES),
        session=ids(t),
        headers=auth_headers(t),
        spec=session_specs(),
        path=path_text,
    )
    def run(
        method: str, route: str, session: str, headers: dict[str, str], spec: dict[str, Any], path: str
    ) -> None:
        url = t.proxy + route.replace("{id}", session)
        keep = (
            {"Authorization": "Bearer not-admin"}
            if method == "DELETE" and session == t.session_id
            else headers
        )
        body = spec if method in ("POST", "PUT", "PATCH") else None
        delete_minted(t, t.send("proxy_routes", method, url, json=body, headers=keep))
        delete_minted(t, t.send("proxy_routes", "POST", t.proxy + "/sessions", json=spec, headers=admin))
        t.send("proxy_routes", method, t.proxy + "/" + path.lstrip("/"), headers=headers)
        t.send("proxy_routes", "GET", f"{t.proxy}/sessions/{session}/calls", headers=admin)
        t.send("proxy_routes", "GET", f"{t.proxy}/sessions/{session}/trace", headers=admin)
        t.send("proxy_routes", "GET", f"{t.proxy}/sessions/{session}", headers=headers)

    run()
    t.healthy()
    assert t.minted, "no generated session spec was ever valid: the mint path went untested"
    listed = [s["session_id"] for s in t.client.get(t.proxy + "/sessions", headers=admin).json()["sessions"]]
    assert listed == [t.session_id]
    assert t.sent["proxy_routes"] >= QUOTAS["proxy_routes"], t.sent


# ---------------------------------------------------------------------------------- the rollout server


def test_rollout_server_with_generated_bodies(targets: Targets) -> None:
    """Rollout requests of the right shape with wrong types, huge numbers, and raw malformed bodies (deep
    nesting, invalid UTF-8, non-JSON): never a 5xx, a JSON 4xx with a message for each rejection; every
    session opened is closed."""
    t = targets

    @fuzz(220)
    @given(
        body=rollout_bodies(), raw=NASTY, wait=st.sampled_from(["0", "x", "nan", "-1", "inf", "1e999", ""])
    )
    def run(body: dict[str, Any], raw: bytes, wait: str) -> None:
        opened = t.send("rollout_bodies", "POST", t.rollout + "/sessions")
        assert opened.status_code == 201, opened.text
        session = f"{t.rollout}/sessions/{opened.json()['session_id']}"
        try:
            t.send("rollout_bodies", "POST", session + "/rollout", content=raw)
            t.send("rollout_bodies", "POST", session + "/rollout", json=body)
            t.send("rollout_bodies", "POST", session + "/rollout", json={"split": "train", **body})
            t.send("rollout_bodies", "GET", f"{session}?wait={wait}")
            t.send("rollout_bodies", "POST", session + "/stop", content=raw)
            t.send("rollout_bodies", "GET", session + "/trace")
        finally:
            t.send("rollout_bodies", "DELETE", session)
        t.send("rollout_bodies", "POST", t.rollout + "/sessions/nope/rollout", json=body)

    run()
    t.healthy()
    assert t.client.get(t.rollout + "/health").json()["sessions"] == 0
    assert t.sent["rollout_bodies"] >= QUOTAS["rollout_bodies"], t.sent


def test_rollout_server_with_random_methods_paths_and_ids(targets: Targets) -> None:
    """Random methods on every route with good, closed and nonsense ids and query strings, plus random
    paths and headers: never a 5xx, unknown routes and methods a JSON 404/405; no session left open."""
    t = targets

    @fuzz(340)
    @given(
        method=st.sampled_from(METHODS),
        route=st.sampled_from(ROLLOUT_ROUTES),
        session=ids(t),
        query=st.text(alphabet=st.characters(min_codepoint=48, max_codepoint=122), max_size=8),
        path=path_text,
        headers=auth_headers(t),
        body=json_values,
    )
    def run(
        method: str, route: str, session: str, query: str, path: str, headers: dict[str, str], body: Any
    ) -> None:
        opened = t.send("rollout_routes", "POST", t.rollout + "/sessions").json()["session_id"]
        try:
            for sid in (opened, session):
                url = t.rollout + route.replace("{id}", sid).replace("{q}", query)
                data = {"json": body} if method in ("POST", "PUT", "PATCH") else {}
                close_opened(t, t.send("rollout_routes", method, url, headers=headers, **data))
            close_opened(
                t, t.send("rollout_routes", method, t.rollout + "/" + path.lstrip("/"), headers=headers)
            )
        finally:
            t.send("rollout_routes", "DELETE", f"{t.rollout}/sessions/{opened}")

    run()
    t.healthy()
    assert t.client.get(t.rollout + "/health").json()["sessions"] == 0
    assert t.sent["rollout_routes"] >= QUOTAS["rollout_routes"], t.sent
