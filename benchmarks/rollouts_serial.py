"""The rollout benchmark's serial part: the toy agent started directly against the engine, then the same
agent through the rollout server one rollout at a time, and the overhead between them broken into phases
(see :mod:`benchmarks.rollouts`)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Server
from benchmarks.rollouts_rig import MODEL, SAMPLING, SPLIT, TASK, task_index
from harness_trainer.examples import TASKS
from harness_trainer.rollouts.client.factory import HarborSessionFactory
from harness_trainer.rollouts.client.session import RolloutUnscorable

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "harness_trainer" / "harnesses" / "toy_agent.py"
PHASES = ("capture_session", "sandbox_start", "install", "agent", "upload", "verifier", "trace", "cleanup")


def raw_runs(engine: Server, steps: int, repeats: int, cwd: Path) -> list[float]:
    """Seconds per direct agent run (start to exit), after one warm-up run."""
    python = shutil.which("python3") or sys.executable  # what the toy harness runs in a local sandbox
    argv = [python, str(AGENT), "--base-url", engine.url + "/v1", "--api-key", "raw", "--model", MODEL]
    argv += ["--steps", str(steps), (TASKS / SPLIT / TASK / "instruction.md").read_text()]
    seconds = []
    for run in range(repeats + 1):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
        elapsed = time.perf_counter() - start
        tools = sum('"tool"' in line for line in done.stdout.splitlines())
        if done.returncode != 0 or tools != steps:
            raise RuntimeError(
                f"raw agent: exit {done.returncode}, {tools}/{steps} tool calls:\n{done.stdout}"
            )
        if run:
            seconds.append(elapsed)
    return seconds


def serial_rollouts(server: Server, steps: int, repeats: int) -> tuple[list[float], list[dict], list[str]]:
    """``repeats`` rollouts in a row after a warm-up: each one's seconds and phase seconds, and what went
    wrong with those that failed (left out of the medians; at most ``repeats`` of them are tried)."""
    factory = HarborSessionFactory(
        server.url, split=SPLIT, harness="toy", sandbox="local", sampling=SAMPLING,
        agent_timeout_sec=120, agent_step_limit=steps,
    )  # fmt: skip
    seconds: list[float] = []
    phases: list[dict[str, float]] = []
    failures: list[str] = []
    try:
        index, warm = task_index(server), True
        while len(seconds) < repeats and len(failures) <= repeats:
            elapsed, phase_seconds, problem = one_rollout(factory, index, steps)
            if problem:
                failures.append(problem)
            elif not warm:
                seconds.append(elapsed)
                phases.append(phase_seconds)
            warm = warm and bool(problem)
    finally:
        factory.close()
    if not seconds:
        raise RuntimeError(f"no rollout succeeded: {failures[:3]}")
    return seconds, phases, failures


def one_rollout(factory: HarborSessionFactory, index: int, steps: int) -> tuple[float, dict[str, float], str]:
    """One rollout, create to close: its seconds, its phase seconds, and what went wrong ('' if nothing)."""
    start = time.perf_counter()
    session = factory.create(index)
    try:
        session.wait_for_completion(timeout_s=120)
        turns = len(session.fetch_training_trace().turns)
        session.verify([])
    except (RolloutUnscorable, TimeoutError) as exc:  # a result of this rollout, not a benchmark failure
        return 0.0, {}, f"{type(exc).__name__}: {exc}"
    finally:
        session.close()
    elapsed, result = time.perf_counter() - start, session.result
    assert result is not None
    if result.model_calls != steps or turns != steps:
        tail = result.log_tail.strip().splitlines()[-1:]
        return elapsed, {}, f"{result.model_calls}/{steps} model calls, agent exit {result.exit_code}: {tail}"
    return elapsed, dict(result.phase_seconds), ""


def summarize_serial(raw: list[float], rollout: list[float], phases: list[dict[str, float]]) -> dict:
    """Medians, and the overhead (rollout − raw) broken into phases: the parts add up to the whole."""
    medians = {name: statistics.median(p.get(name, 0.0) for p in phases) for name in PHASES}
    raw_s, rollout_s = statistics.median(raw), statistics.median(rollout)
    parts = {}
    for name in PHASES:  # the agent phase's share of the overhead is what it took beyond the raw run
        parts["agent - raw" if name == "agent" else name] = medians[name] - (raw_s if name == "agent" else 0)
    parts["rest"] = rollout_s - raw_s - sum(parts.values())
    return {
        "raw": {"median_s": raw_s, "runs_s": raw},
        "rollout": {"median_s": rollout_s, "runs_s": rollout, "phase_medians_s": medians},
        "overhead_s": rollout_s - raw_s,
        "overhead_parts_s": parts,
    }
