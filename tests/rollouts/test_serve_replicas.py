"""``harness-trainer serve --replicas``: its capture proxy routes over every ``--upstream`` as replicas of one
model, and ``GET /health`` lists them as the proxy sees them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.rollouts.server.proxy_process import ProxyProcess
from tests.conftest import EngineProcess, start_engine
from tests.rollouts.conftest import EXAMPLES


@pytest.fixture
def second_engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    running = start_engine(tiny_model_dir)
    yield running
    running.stop()


def serve(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(EXAMPLES), *args]
    environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    return subprocess.Popen(command, env=environ, stderr=subprocess.PIPE, text=True)


def test_the_proxy_child_is_started_with_replicas_only_when_asked(tmp_path: Path) -> None:
    plain = ProxyProcess("http://127.0.0.1:1", tmp_path, "k", "127.0.0.1", 1, allowed_upstreams=("http://b",))
    assert "--replicas" not in plain.argv()
    routed = ProxyProcess(
        "http://127.0.0.1:1", tmp_path, "k", "127.0.0.1", 1, allowed_upstreams=("http://b",), replicas=True
    )
    assert "--replicas" in routed.argv()


@pytest.mark.slow
@pytest.mark.parametrize("proxy", ["process", "in-process"])
def test_serve_with_replicas_reports_each_replica_in_health(
    engine: EngineProcess, second_engine: EngineProcess, tmp_path: Path, proxy: str
) -> None:
    port, capture_port = free_port(), free_port()
    process = serve(
        "--replicas", "--upstream", engine.url, "--upstream", second_engine.url, "--port", str(port),
        "--capture-port", str(capture_port), "--data-dir", str(tmp_path / "capture"), "--proxy", proxy,
    )  # fmt: skip
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        replicas = health["replicas"]
        assert [(r["index"], r["engine"].rstrip("/")) for r in replicas] == [
            (0, engine.url),
            (1, second_engine.url),
        ]
        assert all(r["healthy"] and not r["drained"] for r in replicas)
        assert [e["models"] for e in health["engines"]] == [["tiny"], ["tiny"]]
    finally:
        process.terminate()
        process.wait(30)


def test_serve_without_replicas_reports_none(engine: EngineProcess, tmp_path: Path) -> None:
    port, capture_port = free_port(), free_port()
    process = serve(
        "--upstream", engine.url, "--port", str(port), "--capture-port", str(capture_port),
        "--data-dir", str(tmp_path / "capture"),
    )  # fmt: skip
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process)
        assert "replicas" not in httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
    finally:
        process.terminate()
        process.wait(30)


def test_serve_refuses_replicas_with_an_external_proxy(tmp_path: Path) -> None:
    process = serve(
        "--replicas", "--upstream", "http://127.0.0.1:9", "--capture-url", "http://127.0.0.1:9",
        "--capture-admin-key", "k", "--data-dir", str(tmp_path),
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "--replicas" in stderr


def test_a_replica_down_at_start_is_listed_out_and_with_no_models(
    engine: EngineProcess, tmp_path: Path
) -> None:
    port, capture_port, down = free_port(), free_port(), f"http://127.0.0.1:{free_port()}"
    process = serve(
        "--replicas", "--upstream", engine.url, "--upstream", down, "--port", str(port),
        "--capture-port", str(capture_port), "--data-dir", str(tmp_path / "capture"),
    )  # fmt: skip
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        assert [(r["engine"].rstrip("/"), r["healthy"]) for r in health["replicas"]] == [
            (engine.url, True),
            (down, False),
        ]
        assert [e["models"] for e in health["engines"]] == [["tiny"], []]
    finally:
        process.terminate()
        process.wait(30)
