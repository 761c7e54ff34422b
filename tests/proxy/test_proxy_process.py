"""The proxy as a real process (``harness-trainer proxy``) in front of the real dev engine.

An agent loop with the official SDK, a SIGKILL of the proxy, a restart on the same data dir, and the
trace exported both by the restarted proxy and offline by ``harness-trainer proxy-trace``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvloop

from capture_proxy.cli import new_event_loop
from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.trace import TrainingTrace
from tests.conftest import EngineProcess, start_engine

ADMIN = "process-admin-key"
TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}
]
SCRIPT = [
    {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
    },
    {"content": "There is one file."},
]


@pytest.fixture(scope="module")
def scripted_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    script = tmp_path_factory.mktemp("script") / "script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in SCRIPT * 4))
    engine = start_engine(tiny_model_dir, "--script", str(script), name="tiny-scripted")
    yield engine
    engine.stop()


def start_proxy(upstream: str, data_dir: Path, port: int, loop: str = "auto") -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "harness_trainer.cli",
        "proxy",
        "--upstream",
        upstream,
        "--port",
        str(port),
    ]
    command += ["--data-dir", str(data_dir), "--admin-key", ADMIN, "--loop", loop]
    with open(data_dir.parent / f"proxy-{port}.log", "a") as log:
        process = subprocess.Popen(command, env={**os.environ}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def started_loops(data_dir: Path, port: int) -> list[str]:
    """The event loop each start of the proxy on ``port`` named in its first line."""
    lines = (data_dir.parent / f"proxy-{port}.log").read_text().splitlines()
    return [line.rsplit("event loop: ", 1)[1].rstrip(")") for line in lines if "event loop: " in line]


def agent_loop(base_url: str, session_id: str) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key=session_id, max_retries=0)
    messages: list = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is here?"},
    ]
    first = client.chat.completions.create(model="whatever", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "hello.txt"})
    second = client.chat.completions.create(model="whatever", messages=messages, tools=TOOLS, stream=True)
    return [call.function.name, "".join(c.choices[0].delta.content or "" for c in second if c.choices)]


def export_trace(session_dir: Path, out: Path | None = None) -> Any:
    """``harness-trainer proxy-trace`` of ``session_dir``: the trace it writes."""
    out = out or session_dir.parent.parent.parent / "trace.json"
    command = [
        sys.executable,
        "-m",
        "harness_trainer.cli",
        "proxy-trace",
        str(session_dir),
        "--out",
        str(out),
    ]
    exported = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["auto", "asyncio"])
def test_a_killed_proxy_restarts_with_every_call_and_the_same_trace(
    scripted_engine: EngineProcess, tmp_path: Path, loop: str
) -> None:
    data_dir, port = tmp_path / "data", free_port()
    proxy = start_proxy(scripted_engine.url, data_dir, port, loop)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = f"http://127.0.0.1:{port}"
    try:
        session = httpx.post(url + "/sessions", headers=admin, json={"sampling": {"temperature": 0.8}}).json()
        assert agent_loop(session["base_url"], session["session_id"]) == ["bash", "There is one file."]
        before = httpx.get(f"{url}/sessions/{session['session_id']}/trace", headers=admin).json()
        proxy.send_signal(signal.SIGKILL)
        proxy.wait()
        # As after a machine crash: the journal's second line never left the page cache. The write-ahead
        # log, synced before each reply, still has it; an offline export reads it from there.
        journal = data_dir / "sessions" / session["session_id"] / "calls.jsonl"
        whole = journal.read_bytes()
        first_line = whole.index(b"\n") + 1
        journal.write_bytes(whole[:first_line] + bytes(len(whole) - first_line))
        offline = export_trace(data_dir / "sessions" / session["session_id"], tmp_path / "offline.json")
        assert TrainingTrace.model_validate(offline) == TrainingTrace.model_validate(before)
        proxy = start_proxy(scripted_engine.url, data_dir, port, loop)
        after = httpx.get(f"{url}/sessions/{session['session_id']}/trace", headers=admin).json()
        assert journal.read_bytes() == whole.split(b"\0")[0]  # replayed into the journal
    finally:
        proxy.terminate()
        proxy.wait(timeout=20)
    assert after == before
    assert sorted(p.name for p in (data_dir / "wal").iterdir()) == []  # the stop deleted the log
    assert started_loops(data_dir, port) == 2 * ["uvloop" if loop == "auto" else "asyncio"]
    trace = TrainingTrace.model_validate(after)
    first, second = trace.turns
    assert second.metadata["parent"] == first.node_id  # the real chat template appends: one chain
    assert sum(second.loss_mask) == len(second.completion_token_ids) > 0
    assert first.request["temperature"] == 0.8 and first.request["return_token_ids"] is True

    assert TrainingTrace.model_validate(export_trace(data_dir / "sessions" / session["session_id"])) == trace
    openenv_harness = pytest.importorskip("openenv.core.harness")
    openenv_harness.TrainingTrace.model_validate(after)


def test_proxy_trace_of_a_missing_journal_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "harness_trainer.cli", "proxy-trace", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "cannot read journal" in result.stderr


def test_the_proxy_refuses_a_public_address_without_an_admin_key(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CAPTURE_PROXY_ADMIN_KEY"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "capture_proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2 and "admin key" in result.stderr


def test_a_proxy_started_without_a_key_keeps_one_in_its_data_dir_and_its_admin_routes_need_it(
    tmp_path: Path,
) -> None:
    """Agents in local sandboxes share the host's loopback: a keyless proxy must not leave admin routes
    open to them. It makes a key in DATA_DIR/admin_key (0600), requires it, and keeps it across a restart."""
    env = {k: v for k, v in os.environ.items() if k != "CAPTURE_PROXY_ADMIN_KEY"}
    data, port = tmp_path / "data", free_port()
    command = [sys.executable, "-m", "capture_proxy", "--upstream", "http://127.0.0.1:9", "--port", str(port)]
    command += ["--data-dir", str(data), "--served-model", "m"]
    keys = []
    for _ in range(2):
        process = subprocess.Popen(command, env=env)
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", process)
            key_file = data / "admin_key"
            assert key_file.stat().st_mode & 0o777 == 0o600
            keys.append(key_file.read_text().strip())
            url = f"http://127.0.0.1:{port}/sessions"
            assert httpx.get(url).status_code == 401
            assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(url, headers={"Authorization": f"Bearer {keys[-1]}"}).status_code == 200
        finally:
            process.terminate()
            process.wait(timeout=30)
    assert len(keys[0]) >= 40 and keys[0] == keys[1]


def test_the_event_loop_is_uvloops_where_installed_and_asyncios_when_asked_or_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for kind, expected in [
        ("auto", uvloop.Loop),
        ("uvloop", uvloop.Loop),
        ("asyncio", asyncio.SelectorEventLoop),
    ]:
        loop = new_event_loop(kind)
        loop.close()
        assert isinstance(loop, expected), kind
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as on a platform uvloop has no build for
    loop = new_event_loop("auto")
    loop.close()
    assert isinstance(loop, asyncio.SelectorEventLoop)
    with pytest.raises(ImportError, match="pip install uvloop"):
        new_event_loop("uvloop")
