"""``harness-trainer dev`` as a user runs it: a real process, its files, and Ctrl-C at any moment."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness_trainer.trainer.feed.evaluation import read_eval_rollouts
from tests import ordinary_user
from tests.hardening.faults import alive, descendants, wait_until
from tests.rollouts.conftest import EXAMPLES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def one_task(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "train" / "hello-file", tmp_path / "tasks" / "train" / "hello-file")
    return tmp_path / "tasks"


def with_a_held_out_task(tasks: Path) -> Path:
    shutil.copytree(EXAMPLES / "test" / "greet-script", tasks / "test" / "greet-script")
    return tasks


def dev(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "harness_trainer.cli", "dev", "--harness", "toy", "--no-warmup",
        "--tasks", str(one_task(tmp_path) if not (tmp_path / "tasks").exists() else tmp_path / "tasks"),
        "--output-dir", str(tmp_path / "run"), "--num-generations", "2", "--max-concurrent-rollouts", "2",
        "--max-completion-length", "32",
        # The random tiny model solves nothing: every group's rewards are equal, and kept, not dropped.
        "--no-drop-zero-variance-groups", *extra,
    ]  # fmt: skip


def test_the_dev_loop_runs_to_the_end_and_leaves_metrics_curves_viewer_and_checkpoint(tmp_path):
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "2"), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hello-file" in (run / "viewer.html").read_text()
    assert (run / "checkpoint-2" / "trainer_state.json").exists()
    assert "engine up" in done.stdout and "mean reward" in done.stdout
    assert "no split 'test' in" in done.stdout and "evaluation is off" in done.stdout
    assert not (run / "eval.jsonl").exists()
    for command in (["plot", str(run), "-o", str(tmp_path / "again.png")],
                    ["view", str(run), "-o", str(tmp_path / "again.html")]):  # fmt: skip
        again = subprocess.run(
            [sys.executable, "-m", "harness_trainer.cli", *command], cwd=ROOT, capture_output=True, text=True
        )
        assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.png").exists() and "hello-file" in (tmp_path / "again.html").read_text()


def test_the_dev_loop_in_white_box_mode_trains_the_built_in_adapter_on_the_trainers_own_samples(tmp_path):
    """``--mode white-box``: no agent process, no capture proxy; the trainer samples each turn and the
    built-in ReActAdapter runs the sandbox's tools. The random model calls no tool, so each episode is one
    turn, scored 0, and trained on (its equal-reward groups kept), with a held-out evaluation."""
    with_a_held_out_task(one_task(tmp_path))
    done = subprocess.run(
        dev(tmp_path, "--mode", "white-box", "--max-steps", "2", "--eval-steps", "2"), cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training the white-box ReActAdapter on 1 toy tasks" in done.stdout
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in lines if "reward" in line]
    assert [line["step"] for line in trained] == [1, 2]
    assert all(line["whitebox/turns"] >= 1 and line["rollout/unscorable"] == 0 for line in trained)
    assert [line["step"] for line in lines if "eval/pass@1" in line] == [0, 2]
    assert not (run / "capture").exists()  # no capture proxy ran: the trainer's own model step sampled
    assert (run / "checkpoint-2" / "trainer_state.json").exists()
    assert alive(descendants(os.getpid())) == set()


def test_the_dev_loop_evaluates_the_held_out_split_at_the_start_every_eval_steps_and_the_end(tmp_path):
    with_a_held_out_task(one_task(tmp_path))
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "2", "--eval-steps", "1"), cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["split"], e["task_name"], e["temperature"]) for e in evals] == [
        (step, "test", "greet-script", 0.0) for step in (0, 1, 2)
    ]
    # Each evaluation's sample (k = 1), its real rollout's trace with it.
    samples = read_eval_rollouts(run)
    assert [(s.step, s.task_name, s.reward) for s in samples] == [
        (e["step"], "greet-script", e["rewards"][0]) for e in evals
    ]
    assert all(s.trace is not None and s.trace.turns for s in samples if s.unscorable is None)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval/pass@1" in line] == [0, 1, 2]
    assert "held-out pass@1" in done.stdout
    assert (run / "curves.png").exists()


def test_ctrl_c_stops_everything_and_leaves_a_checkpoint_the_next_run_resumes(tmp_path):
    process = subprocess.Popen(
        dev(tmp_path, "--max-steps", "50"), cwd=ROOT, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            assert process.poll() is None, process.stdout.read()
            time.sleep(0.2)
        started = descendants(process.pid)
        assert started, "the dev loop started no engine"
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, output[-3000:]
    assert wait_until(lambda: not alive(started), 10), alive(started)
    steps = len(metrics.read_text().splitlines())
    assert (tmp_path / "run" / f"checkpoint-{steps}" / "trainer_state.json").exists()

    resumed = subprocess.run(
        dev(tmp_path, "--max-steps", str(steps + 1), "--resume"), cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 2))


def test_an_output_dir_with_an_earlier_runs_checkpoints_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "run" / "checkpoint-3").mkdir(parents=True)
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "1"), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "already holds checkpoints" in done.stderr and "--resume" in done.stderr
    assert "engine up" not in done.stdout
    from harness_trainer.sandboxes.local import LocalSandboxBackend

    assert done.stdout.startswith(f"[dev] sandbox: local, {LocalSandboxBackend.choose_mode().summary}\n")


def test_training_on_a_held_out_split_is_refused_before_anything_starts_warm_up_or_not(tmp_path):
    with_a_held_out_task(one_task(tmp_path))
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "1", "--split", "test"), cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "split 'test' is held out for evaluation" in done.stderr and "--split train" in done.stderr
    assert "engine up" not in done.stdout and not (tmp_path / "run").exists()


def test_the_dev_loop_without_a_vllm_python_stops_before_anything_starts(tmp_path):
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "1", "--engine", "vllm", "--vllm-python", str(tmp_path / "no" / "py")),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and f"no vLLM python at {tmp_path / 'no' / 'py'}" in done.stderr
    assert "scripts/setup_vllm_cpu.sh" in done.stderr and "engine up" not in done.stdout


def test_the_learning_rate_defaults_by_what_is_trained_and_an_explicit_one_wins() -> None:
    import argparse

    from harness_trainer.devloop.run import (
        FULL_LEARNING_RATE,
        LORA_LEARNING_RATE,
        add_dev_arguments,
        build_dev_config,
    )
    from harness_trainer.launch.config_file import apply_config

    parser = argparse.ArgumentParser()
    add_dev_arguments(parser)

    def learning_rate(*argv: str) -> float:
        return build_dev_config(apply_config(parser.parse_args(list(argv)))).learning_rate

    assert learning_rate() == FULL_LEARNING_RATE == 0.05
    assert learning_rate("--lora") == LORA_LEARNING_RATE == 1.0
    assert learning_rate("--lora", "--learning-rate", "1e-9") == 1e-9


def test_the_dev_loop_has_no_flags_for_the_engine_it_starts_itself() -> None:
    import argparse

    from harness_trainer.devloop.run import add_dev_arguments

    parser = argparse.ArgumentParser()
    add_dev_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    for owned in ("--vllm-server-base-url", "--vllm-replica-urls", "--replica-proxy-url"):
        assert owned not in flags  # one engine, started and stopped by the dev loop
    assert "--engine" in flags  # its own: dev or vllm


@pytest.mark.skipif(
    ordinary_user.why_not_available() is not None, reason=str(ordinary_user.why_not_available())
)
def test_the_dev_loop_runs_as_an_ordinary_user_in_rootless_mode_and_adds_nothing_to_the_host() -> None:
    from harness_trainer.models.tiny import default_cache_dir, ensure_tiny_model

    tiny, top = ensure_tiny_model(), sorted(os.listdir("/"))
    with ordinary_user.user_workspace() as workspace:
        mine = workspace / "tmp"
        shutil.copytree(EXAMPLES / "train" / "hello-file", mine / "tasks" / "train" / "hello-file")
        shutil.copytree(tiny, mine / "cache" / "models" / tiny.relative_to(default_cache_dir()))
        for path in [mine, *mine.rglob("*")]:
            shutil.chown(path, ordinary_user.USER)
        argv = dev(mine, "--max-steps", "1")
        done = ordinary_user.run_as_user(argv, workspace, env={"HARNESS_TRAINER_CACHE": str(mine / "cache")})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.startswith("[dev] sandbox: local, rootless: ")
        rollouts = [json.loads(line) for line in (mine / "run" / "rollouts.jsonl").read_text().splitlines()]
        # The trained group's two rollouts ran and were verified (the random model solves nothing); later
        # groups are cancelled when the run ends, as they are as root.
        trained = [r["env_reward"] for r in rollouts if r.get("group") == 0 and r.get("kind") is None]
        assert trained == [0.0, 0.0]
        assert (mine / "run" / "checkpoint-1").is_dir()
    assert sorted(os.listdir("/")) == top
