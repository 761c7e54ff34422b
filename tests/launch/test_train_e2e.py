"""The launcher end to end on CPU: ``examples/async_grpo_harbor/train.py`` and ``harness-trainer train`` as
a user runs them, against a scripted dev engine and a real rollout server (``harness-trainer serve``, local
sandboxes, the toy agent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness_trainer.launch.harbor_run import main
from harness_trainer.launch.preflight import LAUNCH_FILE
from harness_trainer.launch.rewards import TOOL_BONUS, TOOL_CALL_BUDGET
from harness_trainer.trainer.checkpoint import latest_checkpoint
from tests.conftest import start_engine
from tests.rollouts.conftest import bash_call, live_sandbox_processes
from tests.rollouts.test_server import Server

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "async_grpo_harbor" / "train.py"
PROBE = [{"content": "OK"}]  # preflight's one-token completion takes the first scripted reply
SOLVE = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]
GIVE_UP = [{"content": "I cannot do this."}]


@pytest.mark.slow
def two_step_argv(server_url: str, engine_url: str, model_dir: Path, task_index: int) -> list[str]:
    """The launcher's flags for a two-step run of the toy harness on one task, shared by both launch paths."""
    return [
        *("--server", server_url, "--vllm-url", engine_url, "--model", str(model_dir)),
        *("--harness", "toy", "--sandbox", "local", "--engine", "dev", "--task-indices", str(task_index)),
        *("--num-generations", "2", "--max-concurrent-rollouts", "1", "--max-steps", "2"),
        *("--max-staleness", "0", "--learning-rate", "1e-4", "--agent-timeout-sec", "120"),
    ]


def assert_trained_two_steps(out: Path, model_dir: Path, engine_url: str, server_url: str) -> Path:
    """What a two-step launcher run on the toy task leaves: two solved steps, the second checkpoint, the model
    recorded, the engine at version 2, no session or sandbox left. Returns the checkpoint."""
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    solved = 1.0 + TOOL_BONUS * (1 - 1 / TOOL_CALL_BUDGET)  # one bash call
    assert all(step["reward"] == pytest.approx(solved / 2) for step in steps)
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-2"
    assert json.loads((out / LAUNCH_FILE).read_text())["model"] == str(model_dir)
    assert httpx.get(f"{engine_url}/weight_version").json()["weight_version"] == 2
    health = httpx.get(f"{server_url}/health").json()
    assert health["sessions"] == 0 and health["capture_sessions"] == 0
    assert live_sandbox_processes() == []
    return checkpoint


@pytest.mark.slow
def test_the_launcher_trains_two_steps_through_a_real_rollout_server(
    tiny_model_dir, tmp_path, capsys
) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in PROBE + (SOLVE + GIVE_UP) * 6))
    engine = start_engine(tiny_model_dir, "--script", str(script))
    try:
        # Two slots: one rollout at a time, plus the factory's metadata session.
        server = Server(engine.url, tmp_path / "capture", limit=2)
        try:
            tasks = httpx.get(f"{server.url}/splits/train/tasks").json()["tasks"]
            hello = next(t["index"] for t in tasks if t["name"] == "hello-file")
            out = tmp_path / "out"
            argv = two_step_argv(server.url, engine.url, tiny_model_dir, hello)
            result = subprocess.run(
                [sys.executable, str(TRAIN), *argv, "--output-dir", str(out)],
                capture_output=True,
                text=True,
                timeout=240,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            assert result.returncode == 0, result.stderr[-4000:]
            assert result.stdout.startswith("preflight ok: dev engine")

            checkpoint = assert_trained_two_steps(out, tiny_model_dir, engine.url, server.url)

            # The checkpoint it left is refused to another model, and accepted for the same one.
            assert main([*argv, "--output-dir", str(out), "--resume", "--model", "other"]) == 2
            assert "trained from --model" in capsys.readouterr().err
            assert main([*argv, "--output-dir", str(out), "--resume", "--preflight-only"]) == 0
            assert f"resuming from {checkpoint}" in capsys.readouterr().out
        finally:
            server.stop()
    finally:
        engine.stop()


def submit_call() -> dict:
    return {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "submit", "arguments": {}}}],
    }


@pytest.mark.slow
def test_the_launcher_in_white_box_mode_trains_the_built_in_adapter_through_the_servers_tool_sessions(
    tiny_model_dir, tmp_path
) -> None:
    """``--mode white-box``: the trainer samples each turn from the (scripted) engine by token ids, the
    built-in ReActAdapter runs the reply's calls as the rollout server's tools, and the verifier scores the
    sandbox: one episode writes the file and submits (2 tool calls), the next only answers."""
    solve = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), submit_call()]
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in PROBE + (solve + GIVE_UP) * 6))
    engine = start_engine(tiny_model_dir, "--script", str(script))
    try:
        server = Server(engine.url, tmp_path / "capture", limit=2)
        try:
            tasks = httpx.get(f"{server.url}/splits/train/tasks").json()["tasks"]
            hello = next(t["index"] for t in tasks if t["name"] == "hello-file")
            out = tmp_path / "out"
            argv = [
                *("--server", server.url, "--vllm-url", engine.url, "--model", str(tiny_model_dir)),
                *(
                    "--mode",
                    "white-box",
                    "--sandbox",
                    "local",
                    "--engine",
                    "dev",
                    "--task-indices",
                    str(hello),
                ),
                *("--num-generations", "2", "--max-concurrent-rollouts", "1", "--max-steps", "2"),
                *("--max-staleness", "0", "--learning-rate", "1e-4", "--agent-timeout-sec", "120"),
                *("--agent-step-limit", "4", "--output-dir", str(out)),
            ]
            result = subprocess.run(
                [sys.executable, str(TRAIN), *argv], capture_output=True, text=True, timeout=300,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )  # fmt: skip
            assert result.returncode == 0, result.stderr[-4000:]
            steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert len(steps) == 2
            solved = 1.0 + TOOL_BONUS * (1 - 2 / TOOL_CALL_BUDGET)  # bash, then submit
            assert all(step["reward"] == pytest.approx(solved / 2) for step in steps)
            assert all(step["whitebox/turns"] == 1.5 for step in steps)  # 2 turns, then 1
            assert httpx.get(f"{engine.url}/weight_version").json()["weight_version"] == 2
            health = httpx.get(f"{server.url}/health").json()
            assert health["sessions"] == 0 and health["capture_sessions"] == 0  # no capture session at all
            assert live_sandbox_processes() == []
        finally:
            server.stop()
    finally:
        engine.stop()


def run_console_script(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``harness-trainer ARGV`` as a user runs it: the venv's console script, importing this checkout."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "harness-trainer"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_harness_trainer_train_trains_two_steps_through_a_real_rollout_server(
    tiny_model_dir, tmp_path
) -> None:
    """``harness-trainer train``: the same launcher as the example's ``train.py``, the same run, the same
    outputs."""
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in PROBE + (SOLVE + GIVE_UP) * 6))
    engine = start_engine(tiny_model_dir, "--script", str(script))
    try:
        server = Server(engine.url, tmp_path / "capture", limit=2)
        try:
            tasks = httpx.get(f"{server.url}/splits/train/tasks").json()["tasks"]
            hello = next(t["index"] for t in tasks if t["name"] == "hello-file")
            out = tmp_path / "out"
            argv = [*two_step_argv(server.url, engine.url, tiny_model_dir, hello), "--output-dir", str(out)]
            result = run_console_script("train", *argv, timeout=240)
            assert result.returncode == 0, result.stderr[-4000:]
            assert result.stdout.startswith("preflight ok: dev engine")

            checkpoint = assert_trained_two_steps(out, tiny_model_dir, engine.url, server.url)

            # The checkpoint it left is refused to another model, and accepted for the same one.
            refused = run_console_script("train", *argv, "--resume", "--model", "other", timeout=120)
            assert refused.returncode == 2 and "trained from --model" in refused.stderr
            resumed = run_console_script("train", *argv, "--resume", "--preflight-only", timeout=120)
            assert resumed.returncode == 0, resumed.stderr[-4000:]
            assert f"resuming from {checkpoint}" in resumed.stdout
        finally:
            server.stop()
    finally:
        engine.stop()
