"""The README's TRL/OpenEnv snippet, verbatim, trains on CPU.

The only adaptations are the ones the snippet leaves to its reader: the import path, the values of its
names (a local rollout server on the bundled toy tasks instead of an HF dataset, a local sandbox instead
of E2B, the dev engine serving the tiny model instead of vLLM) and ``my_reward``/``dataset``. The agent is
the real mini-swe-agent, eight at once, through a real ``harness-trainer serve`` and its capture proxy.
The engine is in scripted mode (real ids and logprobs of scripted replies): each reply either solves the
task and submits, or submits without solving, so every rollout takes one model call whatever order the
eight agents ask in, and every group has both rewards to learn from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest

from harness_trainer import AsyncGRPOConfig, HarborSessionFactory, HarnessAsyncGRPOTrainer
from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.conftest import start_engine
from tests.harnesses.test_real_agents import call
from tests.rollouts.conftest import EXAMPLES, live_sandbox_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SOLVE = call("bash", command=f"printf 'Hello, Harbor!\\n' > /app/hello.txt && {SUBMIT}")
GIVE_UP = call("bash", command=SUBMIT)


def test_the_documented_snippet_trains_verbatim(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in [SOLVE, GIVE_UP] * 16))
    engine = start_engine(tiny_model_dir, "--script", str(script), name=str(tiny_model_dir))
    port = free_port()
    command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(EXAMPLES)]
    command += ["--upstream", engine.url, "--port", str(port), "--capture-port", str(free_port())]
    command += ["--data-dir", str(tmp_path / "capture"), "--max-concurrent-envs", "9"]
    environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    server = subprocess.Popen(command, env=environ)
    monkeypatch.chdir(tmp_path)  # the snippet names no output_dir: TRL's default, under the working directory
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server)
        vllm_url, model = engine.url, str(tiny_model_dir)
        rows = LocalTaskSource(EXAMPLES).prompt_rows("train")
        dataset = [next(row for row in rows if row["task_name"] == "hello-file")]

        def my_reward(outcome):
            return outcome.env_reward

        # --- the snippet, as documented ---
        # fmt: off
        factory = partial(HarborSessionFactory, f"http://localhost:{port}", split=str(EXAMPLES),
                          harness="mini-swe-agent", sandbox="local", llm_url=vllm_url, model=model)
        config = AsyncGRPOConfig(num_generations=8, max_concurrent_rollouts=8, vllm_server_base_url=vllm_url)
        trainer = HarnessAsyncGRPOTrainer(model=model, harness_session_factory=factory, args=config,
                                          train_dataset=dataset, rollout_reward_fn=my_reward)
        trainer.train()
        # fmt: on
        # --- end of the snippet ---

        out = tmp_path / config.output_dir
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(steps) == 3  # TRL's num_train_epochs=3 over one task, one group of 8 per step
        rollouts = [r for r in read_rollout_log(out) if r.step is not None]  # those the 3 steps took
        assert len(rollouts) == 24 and all(r.capture_session_id and not r.unscorable for r in rollouts)
        assert sorted(r.env_reward for r in rollouts) == [0.0] * 12 + [1.0] * 12
        assert httpx.get(f"{engine.url}/weight_version").json()["weight_version"] == 3
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["sessions"] == 0 and health["capture_sessions"] == 0
        assert live_sandbox_processes() == []
    finally:
        server.terminate()
        server.wait(30)
        engine.stop()
