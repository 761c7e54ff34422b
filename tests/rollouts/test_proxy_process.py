"""The rollout runtime's capture proxy as a child process (``serve``'s default): it comes up with the
runtime's admin key, serves sessions, stops with the runtime, dies with a SIGKILLed parent, and a child
that cannot start is a clear error with its log, leaving nothing behind."""

from __future__ import annotations

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

from harness_trainer.demo import free_port
from harness_trainer.rollouts.proxy_process import ProxyProcessError
from harness_trainer.rollouts.runtime import RolloutRuntime, RuntimeConfig

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
        from harness_trainer.rollouts.runtime import RolloutRuntime, RuntimeConfig

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
