"""Security and isolation: what one capture session's key can (not) see, admin-key checks, unguessable ids,
request size limits, a sandboxed agent against the admin routes, and secrets that never leak.

Each test names the property it proves; each can fail (a leak, an open route, a guessable id).
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from harness_trainer.rollouts.server.routes import MAX_BODY_BYTES, RolloutServer
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask
from tests.hardening.fakes import IdleRuntime
from tests.hardening.secrets_scan import canaries, count_files, leaks_in_bytes, leaks_in_files
from tests.proxy.conftest import ADMIN_KEY, Stack
from tests.proxy.fake_engine import ServerThread
from tests.rollouts.conftest import EXAMPLES

ROOT = Path(__file__).resolve().parents[2]
URLSAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerThread]:
    thread = ServerThread()
    try:
        yield thread
    finally:
        thread.close()


@pytest.fixture
def stack(servers: ServerThread, tmp_path: Path) -> Iterator[Stack]:
    """A fake engine and a capture proxy (admin key ``ADMIN_KEY``) on loopback, fresh per test."""
    made = Stack(servers, tmp_path / "data")
    try:
        yield made
    finally:
        made.close()
        for runner in list(servers.runners):
            servers.stop_runner(runner)


@pytest.fixture
async def rollout_client(tmp_path: Path) -> AsyncIterator[TestClient]:
    """The rollout server's real aiohttp app (idle runtime, the example tasks), in process."""
    runtime = IdleRuntime(RuntimeConfig(upstream="http://127.0.0.1:9", data_dir=tmp_path, served_model="m"))
    server = RolloutServer(runtime, LocalTaskSource(EXAMPLES), max_concurrent_envs=4)
    async with TestClient(TestServer(server.app())) as client:
        yield client


def make_task(root: Path, name: str = "probe") -> HarborTask:
    """A minimal Harbor task folder (no Dockerfile: workspace ``/app``)."""
    folder = root / "tasks" / name
    (folder / "tests").mkdir(parents=True)
    (folder / "environment").mkdir()
    (folder / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 60\n')
    (folder / "instruction.md").write_text("probe\n")
    (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    return HarborTask(
        name=name,
        path=folder,
        instruction="probe",
        config={},
        agent_timeout_sec=60,
        verifier_timeout_sec=30,
        environment=EnvironmentSpec(),
    )


@pytest.fixture
async def local_backend(tmp_path: Path) -> AsyncIterator[LocalSandboxBackend]:
    backend = LocalSandboxBackend(tmp_path / "sandboxes", kill_grace_s=0.5)
    try:
        yield backend
    finally:
        leaked = backend.live
        await backend.aclose()
        assert not leaked, f"a test left sandboxes open: {[s.id for s in leaked]}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(stack: Stack, key: str, text: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return httpx.post(stack.url + "/v1/chat/completions", headers=bearer(key), json=body, timeout=30)


def raw_status(url: str, method: str, path: str, header_line: str) -> int:
    """The status of a request sent over a bare socket (for header values httpx refuses to send)."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{header_line}\r\n"
                     "Content-Length: 0\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def session_bits(token: str) -> int:
    return len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) * 8


# ------------------------------------------------------------------------------------ 1. isolation


def test_no_route_shows_one_sessions_calls_or_trace_to_another_sessions_key(stack: Stack) -> None:
    """Session B's key, in every place a key can go, gets 401/403/404 on every route that could expose
    session A (list, summary, calls, trace, delete, mint) and no response body carries A's id, A's call
    ids or A's message text; B's own agent calls never see A's data, and A is untouched afterwards."""
    a, b = stack.new_session(metadata={"owner": "A"}), stack.new_session()
    a_id, b_id = a["session_id"], b["session_id"]
    secret_text = f"private-to-A-{uuid.uuid4().hex}"
    assert chat(stack, a_id, f"SAY:{secret_text}").status_code == 200
    assert chat(stack, a_id, f"SAY:again {secret_text}").status_code == 200
    a_calls = stack.calls(a_id)
    assert len(a_calls) == 2 and secret_text in json.dumps(a_calls)
    forbidden = [a_id, secret_text, *(str(call["call_id"]) for call in a_calls)]

    routes = [
        ("GET", "/sessions"),
        ("POST", "/sessions"),
        ("GET", f"/sessions/{a_id}"),
        ("GET", f"/sessions/{a_id}/calls"),
        ("GET", f"/sessions/{a_id}/trace"),
        ("DELETE", f"/sessions/{a_id}"),
        ("GET", f"/sessions/{b_id}"),  # not even its own summary: a session key is not an admin key
        ("GET", f"/sessions/{b_id}/calls"),
        ("GET", f"/s/{b_id}/sessions/{a_id}/calls"),
        ("GET", f"/s/{b_id}/v1/sessions/{a_id}/trace"),
        ("GET", f"/v1/sessions/{a_id}/calls"),
        ("GET", f"/s/{b_id}/v1/calls"),
        ("GET", f"/s/{b_id}/v1/trace"),
    ]
    key_places = [
        bearer(b_id),
        {"x-api-key": b_id},
        {"Authorization": f"Bearer {b_id}", "x-api-key": b_id},
        {"Authorization": f"Bearer {b_id}", "x-api-key": ADMIN_KEY[:-1] + "X"},
    ]
    sent = 0
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for method, route in routes:
            for headers in key_places:
                response = client.request(
                    method, route, headers=headers, json={} if method == "POST" else None
                )
                sent += 1
                assert response.status_code in (401, 403, 404, 405), (method, route, headers, response.text)
                leaked = [item for item in forbidden if item in response.text]
                assert not leaked, (method, route, response.text)
        # B's own agent routes answer B only (the bearer, x-api-key and path-prefix forms alike)
        for route, headers in [
            ("/v1/chat/completions", bearer(b_id)),
            ("/v1/chat/completions", {"x-api-key": b_id}),
            (f"/s/{b_id}/v1/chat/completions", {}),
            (f"/s/{b_id}/v1/chat/completions", {"x-api-key": "not-a-session"}),
        ]:
            response = client.post(route, headers=headers, json={"model": "m", "messages": [
                {"role": "user", "content": "SAY:what did A say?"}]})  # fmt: skip
            assert response.status_code == 200, response.text
            assert not [item for item in forbidden if item in response.text]
        for route in ("/v1/models", f"/s/{b_id}/v1/models", "/health", "/metrics"):
            response = client.get(route, headers=bearer(b_id))
            assert response.status_code == 200 and not [item for item in forbidden if item in response.text]
        # a near miss of A's id (truncated, case-flipped, with B's key alongside) is not A's id
        for near in (a_id[:-1], a_id + "x", a_id.swapcase(), a_id[3:], a_id.upper()):
            for route, headers in [("/v1/chat/completions", bearer(near)), (f"/s/{near}/v1/chat/completions",
                                                                             bearer(b_id))]:  # fmt: skip
                response = client.post(route, headers=headers, json={"model": "m", "messages": [
                    {"role": "user", "content": "SAY:x"}]})  # fmt: skip
                assert response.status_code == 401 and a_id not in response.text, (near, response.text)
    assert sent == len(routes) * len(key_places)
    assert stack.calls(a_id) == a_calls  # nothing B did reached A's journal or deleted A
    assert len(stack.calls(b_id)) == 4
    assert secret_text not in json.dumps(stack.calls(b_id))


# --------------------------------------------------------------------------------- 2. the admin key

ADMIN_ROUTES = [
    ("POST", "/sessions"),
    ("GET", "/sessions"),
    ("GET", "/sessions/{id}"),
    ("GET", "/sessions/{id}/calls"),
    ("GET", "/sessions/{id}/trace"),
    ("DELETE", "/sessions/{id}"),
]


def test_admin_routes_refuse_everything_but_the_admin_key(stack: Stack) -> None:
    """No key, an empty Bearer, a wrong key of the same length, the admin key with one character changed
    or with a suffix, the right key under another scheme or header, and a session's own key: every admin
    route answers 401 with a JSON error, and nothing is minted, read or deleted."""
    session = stack.new_session()
    session_id = session["session_id"]
    assert chat(stack, session_id, "SAY:hello").status_code == 200
    same_length = "x" * len(ADMIN_KEY)
    one_off = ADMIN_KEY[:-1] + chr(ord(ADMIN_KEY[-1]) ^ 1)
    refused: list[dict[str, str]] = [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {same_length}"},
        {"Authorization": f"Bearer {one_off}"},
        {"Authorization": f"Bearer {ADMIN_KEY}x"},
        {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"},
        {"Authorization": f"Bearer {ADMIN_KEY.upper()}"},
        {"Authorization": f"Basic {base64.b64encode(f'admin:{ADMIN_KEY}'.encode()).decode()}"},
        {"Authorization": f"Token {ADMIN_KEY}"},
        {"Authorization": ADMIN_KEY},
        {"x-api-key": ADMIN_KEY},
        {"Authorization": f"Bearer {session_id}"},
        {"x-api-key": session_id},
    ]
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for method, template in ADMIN_ROUTES:
            route = template.format(id=session_id)
            for headers in refused:
                response = client.request(
                    method, route, headers=headers, json={} if method == "POST" else None
                )
                assert response.status_code == 401, (method, route, headers, response.text)
                assert "admin key" in response.json()["error"]["message"]
            # an empty Bearer with trailing space (h11 will not send it; a raw client can)
            assert raw_status(stack.url, method, route, "Authorization: Bearer   ") == 401
            # the key in the query string is not a key either
            assert client.request(method, f"{route}?key={ADMIN_KEY}&api_key={ADMIN_KEY}").status_code == 401
    listed = stack.admin.get("/sessions").json()["sessions"]
    assert [s["session_id"] for s in listed] == [session_id]
    assert len(stack.calls(session_id)) == 1


# --------------------------------------------------------------------------------------- 3. ids


def entropy_bits_per_char(ids: list[str]) -> float:
    counts = Counter(char for token in ids for char in token)
    total = sum(counts.values())
    return -sum(n / total * math.log2(n / total) for n in counts.values())


def check_random_tokens(tokens: list[str], *, length: int, min_bits: int) -> None:
    assert len(set(tokens)) == len(tokens), "two ids collided"
    for token in tokens:
        assert len(token) == length and set(token) <= URLSAFE, token
        assert session_bits(token) >= min_bits
    # the characters are spread over the whole URL-safe alphabet, close to 6 bits each; and no position
    # is stuck (a counter, a timestamp or a constant would show up as a position with few values)
    # (the last character of a 16- or 32-byte token carries only 2 or 4 random bits, hence the slice)
    assert entropy_bits_per_char([t[:-1] for t in tokens]) > 5.95
    for position in range(length - 1):
        assert len({token[position] for token in tokens}) >= 60, position
    assert len({token[:4] for token in tokens}) > len(tokens) * 0.99


@pytest.mark.slow
def test_capture_session_ids_are_unguessable(stack: Stack) -> None:
    """2000 capture session ids minted through the admin API: all distinct, ``cs_`` + 43 URL-safe
    characters = 256 random bits (≥ 128 required), characters spread over the whole alphabet."""
    ids = []
    with httpx.Client(base_url=stack.url, headers=bearer(ADMIN_KEY), timeout=30) as admin:
        for _ in range(2000):
            response = admin.post("/sessions", json={})
            assert response.status_code == 201, response.text
            ids.append(response.json()["session_id"])
        try:
            assert all(i.startswith("cs_") for i in ids)
            check_random_tokens([i.removeprefix("cs_") for i in ids], length=43, min_bits=256)
        finally:
            for session_id in ids:
                assert admin.delete(f"/sessions/{session_id}").status_code == 200
        assert admin.get("/sessions").json()["sessions"] == []


async def test_rollout_server_session_ids_are_unguessable(rollout_client: TestClient) -> None:
    """2000 rollout-server session ids: all distinct, 22 URL-safe characters = 128 random bits, spread
    over the alphabet; each slot is given back (the server ends with no session open)."""
    ids = []
    for _ in range(2000):
        opened = await rollout_client.post("/sessions")
        assert opened.status == 201, await opened.text()
        session_id = (await opened.json())["session_id"]
        ids.append(session_id)
        assert (await rollout_client.delete(f"/sessions/{session_id}")).status == 200
    check_random_tokens(ids, length=22, min_bits=128)
    assert (await (await rollout_client.get("/health")).json())["sessions"] == 0


def test_the_runtimes_generated_admin_key_is_unguessable(tmp_path: Path) -> None:
    """A rollout runtime that is not given an admin key makes a fresh one of ≥ 128 random bits."""
    keys = [
        RolloutRuntime(RuntimeConfig(upstream="http://x", data_dir=tmp_path)).admin_key for _ in range(200)
    ]
    assert len(set(keys)) == 200
    assert all(set(key) <= URLSAFE and session_bits(key) >= 128 for key in keys)


# ------------------------------------------------------------------------------- 4. size limits


def test_the_proxy_answers_413_to_bodies_over_its_limit(servers: ServerThread, tmp_path: Path) -> None:
    """Over ``max_body_bytes``, with or without a Content-Length, on agent and admin routes: a 413 with a
    message naming the limit, and the proxy is fine afterwards (a body under the limit still works)."""
    limit = 64 * 1024
    small = Stack(servers, tmp_path / "data", max_body_bytes=limit)
    try:
        session_id = small.new_session()["session_id"]
        padding = "x" * (limit + 1024)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": padding}]}).encode()

        def chunked() -> Iterator[bytes]:
            for start in range(0, len(body), 8192):
                yield body[start : start + 8192]

        for route, headers in [
            ("/v1/chat/completions", bearer(session_id)),
            ("/v1/messages", {"x-api-key": session_id}),
            ("/v1/responses", bearer(session_id)),
            (f"/s/{session_id}/v1/chat/completions", {}),
            ("/v1/messages/count_tokens", {"x-api-key": session_id}),
            ("/sessions", bearer(ADMIN_KEY)),
        ]:
            for content in (body, chunked()):
                response = httpx.post(small.url + route, content=content, headers=headers, timeout=30)
                assert response.status_code == 413, (route, response.status_code, response.text)
                assert str(limit) in response.text or "too large" in response.text.lower(), response.text
        assert httpx.get(small.url + "/health").status_code == 200
        assert chat(small, session_id, "SAY:fine").status_code == 200
        assert small.calls(session_id)[-1]["kind"] == "model"
    finally:
        small.close()
        for runner in list(servers.runners):
            servers.stop_runner(runner)


def test_the_proxys_default_body_limit_is_finite() -> None:
    """The default configuration caps bodies (32 MiB), so a client cannot make the proxy buffer without
    end."""
    from capture_proxy.config import ProxyConfig

    assert 0 < ProxyConfig(upstream="http://x", data_dir=Path(".")).max_body_bytes <= 64 * 1024 * 1024


async def test_the_rollout_server_answers_413_to_bodies_over_its_limit(rollout_client: TestClient) -> None:
    """Over ``MAX_BODY_BYTES`` (with or without Content-Length): a JSON 413 naming the limit; the slot is
    still usable afterwards."""
    session_id = (await (await rollout_client.post("/sessions")).json())["session_id"]
    body = json.dumps({"split": "train", "index": 0, "episode_id": "x" * (MAX_BODY_BYTES + 10)}).encode()

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    for content in (body, chunked()):
        response = await rollout_client.post(f"/sessions/{session_id}/rollout", data=content)
        assert response.status == 413
        error = (await response.json())["error"]
        assert error["code"] == 413 and str(MAX_BODY_BYTES) in error["message"]
    started = await rollout_client.post(
        f"/sessions/{session_id}/rollout", json={"split": "train", "index": 0}
    )
    assert started.status == 202, await started.text()
    assert (await rollout_client.delete(f"/sessions/{session_id}")).status == 200


# ----------------------------------------------------------------------- 5. a sandboxed agent

PROBE = r"""
import json, sys, urllib.request
base, key, other = sys.argv[1], sys.argv[2], sys.argv[3]
results = {}
for method, route in [("POST", "/sessions"), ("GET", "/sessions"), ("GET", "/sessions/" + key),
                      ("GET", "/sessions/" + key + "/calls"), ("GET", "/sessions/" + key + "/trace"),
                      ("GET", "/sessions/" + other), ("GET", "/sessions/" + other + "/calls"),
                      ("DELETE", "/sessions/" + other)]:
    for name, headers in [("bearer", {"Authorization": "Bearer " + key}), ("x-api-key", {"x-api-key": key}),
                          ("none", {})]:
        data = b"{}" if method == "POST" else None
        request = urllib.request.Request(base + route, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=20) as response:
                status, body = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, body = error.code, error.read().decode()
        results[f"{method} {route.replace(key, '<own>').replace(other, '<other>')} {name}"] = [status, body]
print(json.dumps(results))
"""


async def test_a_sandboxed_agent_cannot_use_its_session_key_on_the_admin_routes(
    stack: Stack, local_backend: LocalSandboxBackend, tmp_path: Path
) -> None:
    """From inside a local sandbox, with its session key (Bearer, x-api-key) or none, every admin route
    (mint, list, read its own or another session, delete another) answers 401 and reveals nothing; the
    other session is intact. Python's urllib from the sandbox, as an agent would do it."""
    own, other = stack.new_session(), stack.new_session()
    assert chat(stack, other["session_id"], "SAY:other's secret words").status_code == 200
    sandbox = await local_backend.start(
        make_task(tmp_path), lifetime_s=60, env={"OPENAI_API_KEY": own["session_id"]}
    )
    try:
        await sandbox.write_file("/app/probe.py", PROBE)
        result = await sandbox.exec(
            f'{sys.executable} /app/probe.py {stack.url} "$OPENAI_API_KEY" {other["session_id"]}',
            timeout_s=60,
        )
        assert result.exit_code == 0, result.stdout + result.stderr
        results = json.loads(result.stdout)
    finally:
        await sandbox.close()
    assert len(results) == 24
    for name, (status, body) in results.items():
        assert status == 401, (name, status, body)
        assert "secret words" not in body and other["session_id"] not in body
    assert len(stack.calls(other["session_id"])) == 1
    assert len(stack.admin.get("/sessions").json()["sessions"]) == 2


# ------------------------------------------------------------------------------ 6. secrets


async def test_the_sandbox_environment_holds_none_of_the_hosts_secrets(
    local_backend: LocalSandboxBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every secret-looking variable set in the parent, neither ``env`` in a sandbox nor its
    init's ``/proc/1/environ`` shows any of them (nor a base64/URL-encoded form)."""
    values = canaries()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    sandbox = await local_backend.start(make_task(tmp_path), lifetime_s=60)
    try:
        shown = await sandbox.exec("env; echo ---; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'")
        assert shown.exit_code == 0, shown.stderr
    finally:
        await sandbox.close()
    assert "HOME=/home/user" in shown.stdout  # the probe did see the environment
    assert not [name for name in values if f"{name}=" in shown.stdout]
    assert leaks_in_bytes((shown.stdout + shown.stderr).encode(), values, "the sandbox environment") == []


@pytest.mark.slow
def test_a_dev_loop_run_writes_and_prints_no_secret(tmp_path: Path) -> None:
    """``harness-trainer dev`` (toy agent, one step) with every secret-looking variable set to a canary:
    no canary, in any raw, base64 or URL-encoded form, in any file the run leaves (metrics, rollouts,
    viewer, checkpoint, capture journals, engine log, temp files, the model cache it touched) or in its
    stdout/stderr; neither is the capture proxy's generated admin key (read from the process by
    ``tests.hardening.devloop_spy``) written anywhere or printed."""
    values = canaries()
    tasks = tmp_path / "tasks" / "train"
    shutil.copytree(EXAMPLES / "train" / "hello-file", tasks / "hello-file")
    scratch, keyfile, run = tmp_path / "tmp", tmp_path / "keys" / "admin-keys", tmp_path / "run"
    scratch.mkdir()
    keyfile.parent.mkdir()
    env = {**os.environ, **values, "TMPDIR": str(scratch)}
    command = [
        sys.executable, "-m", "tests.hardening.devloop_spy", str(keyfile),
        "dev", "--harness", "toy", "--no-warmup", "--tasks", str(tmp_path / "tasks"),
        "--output-dir", str(run),
        "--num-generations", "2", "--max-concurrent-rollouts", "2", "--max-completion-length", "32",
        "--max-steps", "1", "--no-drop-zero-variance-groups",  # the random model: every reward is 0
    ]  # fmt: skip
    started = time.time() - 1
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output.decode(errors="replace")[-4000:]
    admin_keys = keyfile.read_text().split()
    assert admin_keys, "the dev loop started no rollout runtime"
    looked_for = {**values, **{f"admin key {i}": key for i, key in enumerate(admin_keys)}}
    # the run really produced what is scanned
    assert (run / "metrics.jsonl").exists() and (run / "viewer.html").exists()
    assert any(run.glob("checkpoint-*/trainer_state.json")) and (run / "rollouts.jsonl").exists()
    assert count_files([run]) >= 10
    from harness_trainer.models.tiny import default_cache_dir

    leaks = leaks_in_bytes(output, looked_for, "the dev loop's stdout/stderr")
    leaks += leaks_in_files([run, scratch, tmp_path / "tasks"], looked_for)
    leaks += leaks_in_files([default_cache_dir()], looked_for, newer_than=started)
    assert leaks == []


def test_the_secret_scan_finds_a_planted_canary_in_every_form(tmp_path: Path) -> None:
    """The scan the leak tests rely on does find a canary written raw, base64 (std or URL-safe, any
    alignment), or URL-encoded; a clean file gives nothing."""
    values = canaries(["HF_TOKEN"])
    value = values["HF_TOKEN"].encode()
    planted = {
        "raw.txt": b"token=" + value,
        "b64.txt": base64.b64encode(b"Authorization: Bearer " + value + b"!"),
        "b64url.txt": base64.urlsafe_b64encode(b"xy" + value),
        "url.txt": b"?token=" + quote(value.decode(), safe="").encode(),
    }
    for name, data in planted.items():
        (tmp_path / name).write_bytes(data)
        assert leaks_in_files([tmp_path / name], values), name
    (tmp_path / "clean.txt").write_bytes(b"nothing here " * 100)
    assert leaks_in_files([tmp_path / "clean.txt"], values) == []
