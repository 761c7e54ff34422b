"""The trainer on real rollouts: the in-process factory, local sandboxes, the toy agent, a dev engine that
takes the trainer's weights."""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest

from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, LocalSessionFactory
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.rollouts.conftest import EXAMPLES, bash_call, live_sandbox_processes, scripted_engine  # noqa: F401

SOLVE = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]
GIVE_UP = [{"content": "I cannot do this."}]


@pytest.mark.slow
def test_training_on_real_rollouts_pushes_weights_to_the_engine(scripted_engine, tiny_model_dir, tmp_path):  # noqa: F811
    engine = scripted_engine((SOLVE + GIVE_UP) * 6)
    rows = [r for r in LocalTaskSource(EXAMPLES).prompt_rows("train") if r["task_name"] == "hello-file"]
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), engine="dev", vllm_server_base_url=engine.url, num_generations=2,
        max_concurrent_rollouts=1, max_staleness=0, max_steps=2, learning_rate=1e-4, disable_tqdm=True,
        rollout_timeout=120, token_budget=4096,
    )  # fmt: skip
    builder = partial(LocalSessionFactory, str(EXAMPLES), upstream=engine.url, split="train", harness="toy")
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder, config, train_dataset=rows)
    trainer.train()
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert all(line["reward_std"] > 0 and line["loss"] != 0 for line in lines)
    assert lines[0]["tools/call_frequency"] == 0.5
    assert httpx.get(f"{engine.url}/weight_version").json()["weight_version"] == 2
    assert live_sandbox_processes() == []
    # The trainer told the capture proxy each version it pushed, so every call is stamped when sent.
    records = [r for r in read_rollout_log(tmp_path / "out") if r.step is not None and r.trace is not None]
    assert {r.step for r in records} == {1, 2}
    assert all(r.dispatch_version_min is not None for r in records)
    assert {r.dispatch_version_min for r in records if r.step == 1} == {0}
    assert {r.dispatch_version_max for r in records} <= {0, 1}
    assert all(r.return_version_min is not None and r.llm_s > 0 for r in records)
    assert all("perf/rollout_llm_s" in line and line["perf/rollout_env_s"] > 0 for line in lines)
    # Each rollout's local sandbox was open for part of its wall time: what a billing backend would charge.
    assert all(0 < line["sandbox/seconds_per_rollout"] < line["rollout/seconds_mean"] for line in lines)
