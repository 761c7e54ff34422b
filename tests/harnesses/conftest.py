"""Fixtures for the harness tests: a scripted engine behind a real capture proxy, the tiny tokenizer, a
fake sandbox that records what a harness asks of it, and the real agent packages in the host tool cache."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness_trainer.examples import TASKS as EXAMPLES  # noqa: F401 - for the tests here
from harness_trainer.harnesses.bundles import ensure_bundle
from harness_trainer.harnesses.tools import ToolPackage, ensure_host_install
from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.sandboxes.base import ExecResult
from tests.conftest import EngineProcess, start_engine

ADMIN_KEY = "harness-tests-admin"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@dataclass
class CaptureStack:
    """A scripted dev engine and a capture proxy in front of it, both real processes on loopback."""

    engine: EngineProcess
    proxy: subprocess.Popen[bytes]
    url: str
    replies: list[dict[str, Any]]
    admin: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.admin = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )

    def new_session(self) -> str:
        response = self.admin.post("/sessions", json={"sampling": {"temperature": 1.0}})
        assert response.status_code == 201, response.text
        return str(response.json()["session_id"])

    def get(self, path: str) -> Any:
        response = self.admin.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    def close(self) -> None:
        for session in self.get("/sessions").get("sessions", []):
            self.admin.delete(f"/sessions/{session['session_id']}")
        self.admin.close()
        if self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        self.engine.stop()


@pytest.fixture
def capture_stack(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[Callable[[list[dict[str, Any]]], CaptureStack]]:
    """``start(replies)``: an engine that answers with ``replies`` in order, and a proxy in front of it."""
    started: list[CaptureStack] = []

    def start(replies: list[dict[str, Any]]) -> CaptureStack:
        script = tmp_path / f"script-{len(started)}.jsonl"
        script.write_text("\n".join(json.dumps(reply) for reply in replies) + "\n")
        engine = start_engine(tiny_model_dir, "--script", str(script), name="tiny")
        port = free_port()
        argv = [sys.executable, "-m", "harness_trainer.cli", "proxy", "--upstream", engine.url]
        argv += ["--port", str(port), "--data-dir", str(tmp_path / f"capture-{len(started)}")]
        proxy = subprocess.Popen([*argv, "--admin-key", ADMIN_KEY], env=dict(os.environ))
        stack = CaptureStack(engine, proxy, f"http://127.0.0.1:{port}", replies)
        started.append(stack)
        wait_until_healthy(stack.url, proxy)
        return stack

    yield start
    for stack in started:
        stack.close()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def install_agent() -> Callable[[ToolPackage], Path]:
    """Make a real agent runnable in a local sandbox, once per machine: an npm agent's bundle, a pip agent's
    venv in the host tool cache (what ``install_agent`` uses for a sandbox on this machine's files)."""
    done: dict[ToolPackage, Path] = {}

    def install(package: ToolPackage) -> Path:
        if package not in done:  # in a thread of its own: the caller may be inside an event loop
            make = ensure_host_install if package.manager == "pip" else ensure_bundle
            with ThreadPoolExecutor(1) as pool:
                done[package] = pool.submit(asyncio.run, make(package)).result()
        return done[package]

    return install


class FakeSandbox:
    """Records what a harness asks of a sandbox; ``agent`` plays the agent for each exec (it may write
    files, e.g. its log) and returns the exec's result."""

    shares_host_filesystem = False

    def __init__(self, agent: Callable[[FakeSandbox, str], ExecResult] | None = None) -> None:
        self.id = "fake-1"
        self.workdir = "/app"
        self.home = "/home/user"
        self.files: dict[str, bytes] = {}
        self.modes: dict[str, int] = {}
        self.execs: list[dict[str, Any]] = []
        self.agent = agent

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        self.execs.append({"command": command, "timeout_s": timeout_s, "env": env, "cwd": cwd})
        return self.agent(self, command) if self.agent else ExecResult(0, "", "")

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data
        self.modes[path] = mode

    async def read_file(self, path: str) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    async def upload_dir(self, local: Path, remote: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass
