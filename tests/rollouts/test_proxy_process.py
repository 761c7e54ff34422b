"""The rollout runtime's capture proxy as a child process (``serve``'s default): it comes up with the
runtime's admin key, serves sessions, stops with the runtime, dies with a SIGKILLed parent, and a child
that cannot start is a clear error with its log, leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from harness_trainer.net import free_port
from harness_trainer.rollouts.server.proxy_process import ProxyProcessError
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


async def test_child_proxy_serves_sessions_and_stops_with_the_runtime(tmp_path: Path) -> None:
    port = free_port()
    config = RuntimeConfig(
        upstream="http://127.0.0.1:9", data_dir=tmp_path, served_model="m", capture_port=port,
        proxy_process=True,
    )  # fmt: skip
    runtime = RolloutRuntime(config)
    await runtime.start()
    try:
        pid = runtime.proxy_pid
        assert pid is not None and alive(pid) and pid != os.getpid()
        assert runtime.capture is not None
        session = await runtime.capture.mint({"temperature": 1.0}, 3, {"task": "t"})
        assert session.root_url == f"http://127.0.0.1:{port}"
        assert [s["session_id"] for s in await runtime.capture.sessions()] == [session.session_id]
        # Admin routes want the runtime's key; the key is in the child's environment, not its argv.
        assert httpx.get(f"http://127.0.0.1:{port}/sessions").status_code == 401
        assert runtime.admin_key not in Path(f"/proc/{pid}/cmdline").read_text()
        await runtime.capture.delete(session.session_id)
    finally:
        await runtime.aclose()
    assert wait_gone(pid, 5)
    assert runtime.proxy_pid is None


async def test_a_proxy_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = RuntimeConfig(
            upstream="http://127.0.0.1:9", data_dir=tmp_path, served_model="m", capture_port=port,
            proxy_process=True,
        )  # fmt: skip
        runtime = RolloutRuntime(config)
        with pytest.raises(ProxyProcessError, match="exited") as info:
            await runtime.start()
        assert "address already in use" in str(info.value).lower()
        assert runtime.capture is None and runtime.proxy_pid is None
        await runtime.aclose()


def test_the_child_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    port = free_port()
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig

        async def main():
            config = RuntimeConfig(upstream="http://127.0.0.1:9", data_dir={str(tmp_path)!r},
                                   served_model="m", capture_port={port}, proxy_process=True)
            runtime = RolloutRuntime(config)
            await runtime.start()
            print(runtime.proxy_pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert wait_gone(child), "the proxy outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def children(pid: int) -> list[str]:
    """The argv (joined) of ``pid``'s children."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return found


@pytest.mark.parametrize("mode", ["process", "in-process"])
def test_serve_runs_its_proxy_as_asked_and_stops_it_on_sigterm(tmp_path: Path, mode: str) -> None:
    from tests.rollouts.conftest import EXAMPLES

    port, capture = free_port(), free_port()
    options = [
        "--dataset", str(EXAMPLES), "--upstream", "http://127.0.0.1:9", "--served-model", "m", "--port",
        str(port), "--capture-port", str(capture), "--data-dir", str(tmp_path / "capture"), "--proxy", mode,
    ]  # fmt: skip
    if mode == "in-process":  # the same options from a --config file's serve section
        config = {"dataset": [str(EXAMPLES)], "upstream": "http://127.0.0.1:9", "served_model": "m",
                  "port": port, "capture_port": capture, "proxy": mode}  # fmt: skip
        config["data_dir"] = str(tmp_path / "capture")
        (tmp_path / "serve.yaml").write_text(json.dumps({"serve": config}))  # JSON is YAML
        options = ["--config", str(tmp_path / "serve.yaml")]
    serve = subprocess.Popen(
        [sys.executable, "-m", "harness_trainer.cli", "serve", *options],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert serve.poll() is None and time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{capture}/health", timeout=2).status_code == 200
        proxies = [argv for argv in children(serve.pid) if "capture_proxy" in argv]
        assert len(proxies) == (1 if mode == "process" else 0)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{capture}/health", timeout=2)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
