"""Multi-step Harbor tasks run as their steps: one sandbox, one capture session, the agent started again on
each step's instruction, each step verified with the task's tests/ under its own, the rewards rolled up.

The task (``tests/harbor_shaped/steps/service-env-export``, written here in the shape of Harbor's
multi-step tasks) has two steps: export an INI file as an env file (``min_reward = 1.0``), then apply
overrides that the second step's ``workdir/`` brings, made read-only by its ``setup.sh``. Both steps'
verifiers are the task-level ``test.sh`` and ``common.py`` with the step's own ``check_step.py`` beside them.

The toy agent replays each step's ``solution/solve.sh`` through the scripted dev engine on the local
sandbox (fast tier); real mini-swe-agent and opencode do the same on the Docker backend (the image has no
Node). A rollout that fails the first step stops there: the second does not run and scores 0.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.harnesses.mini_swe_agent import SUBMIT_COMMAND
from harness_trainer.rollouts.result import RolloutOptions, RolloutResult
from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.task import HarborTask
from tests.rollouts.conftest import bash_call

TASK = Path(__file__).resolve().parents[1] / "harbor_shaped" / "steps" / "service-env-export"

Replies = list[dict[str, Any]]


def for_the_local_sandbox(task: Path, tmp_path: Path) -> Path:
    """A copy of ``task`` whose Dockerfile has no ``RUN`` line: the local sandbox runs a Dockerfile's
    commands on this machine (its ``/var`` and ``/usr`` are the host's), so an image's ``apt-get`` would
    install on the host, and two tests doing it at once collide on apt's lock."""
    copy = tmp_path / task.name
    shutil.copytree(task, copy)
    dockerfile = copy / "environment" / "Dockerfile"
    lines = dockerfile.read_text().replace("\\\n", " ").splitlines()
    dockerfile.write_text("\n".join(line for line in lines if not line.startswith("RUN ")) + "\n")
    return copy


def solve(task: HarborTask, step: int) -> str:
    solution = task.steps[step].solution
    assert solution is not None
    return solution.read_text()


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def replay(agent: str, command: str) -> Replies:
    """The replies with which ``agent`` runs ``command`` in its shell tool, then ends its run."""
    return {
        "toy": [bash_call(command), {"content": "Done."}],
        "mini-swe-agent": [call("bash", command=command), call("bash", command=SUBMIT_COMMAND)],
        "opencode": [call("bash", command=command, description="Apply the step"), {"content": "Done."}],
    }[agent]


def give_up(agent: str) -> Replies:
    if agent == "mini-swe-agent":
        return [call("bash", command=SUBMIT_COMMAND)]
    return [{"content": "I will not change anything."}]


def assert_solved(result: RolloutResult, agent: str) -> None:
    assert result.error is None, result.error
    assert [(s.name, s.reward) for s in result.steps] == [("01-export", 1.0), ("02-overrides", 1.0)], (
        result.log_tail[-3000:]
    )
    assert result.reward == 1.0 and "mean of 2 steps" in result.reward_detail
    turns = result.trace["turns"] if result.trace else []
    assert len(turns) == len(replay(agent, "x")) * 2  # both agent runs went into the one capture session


def assert_stopped_after_the_first_step(result: RolloutResult) -> None:
    assert result.error is None, result.error
    assert [(s.name, s.reward) for s in result.steps] == [("01-export", 0.0)]
    assert result.reward == 0.0 and "the rest not run" in result.reward_detail


async def test_the_steps_run_in_turn_in_one_sandbox_and_a_missed_minimum_ends_the_rollout(
    runtime_for: Callable[[Replies], Any], tmp_path: Path
) -> None:
    task = load_task(for_the_local_sandbox(TASK, tmp_path), split="steps")
    runtime = await runtime_for(
        [*replay("toy", solve(task, 0)), *replay("toy", solve(task, 1)), *give_up("toy")]
    )
    options = RolloutOptions(harness="toy", sandbox="local", agent_timeout_sec=120)
    solved = await runtime.rollout(task, options)
    assert_solved(solved, "toy")
    assert solved.tool_calls_by_name == {"bash": 2} and solved.model_calls == 4
    assert set(solved.phase_seconds) >= {"setup", "agent", "verifier"}
    assert_stopped_after_the_first_step(await runtime.rollout(task, options))


async def test_a_step_whose_setup_hook_fails_makes_the_rollout_unscorable(
    runtime_for: Callable[[Replies], Any], tmp_path: Path
) -> None:
    """A broken ``setup.sh`` is the task's fault, never the agent's: no reward, the error names the step."""
    broken = for_the_local_sandbox(TASK, tmp_path)
    (broken / "steps" / "02-overrides" / "workdir" / "setup.sh").write_text("echo no overrides >&2; exit 3\n")
    task = load_task(broken, split="steps")
    runtime = await runtime_for([*replay("toy", solve(task, 0))])
    options = RolloutOptions(harness="toy", sandbox="local", agent_timeout_sec=120)
    result = await runtime.rollout(task, options)
    assert result.reward is None and result.error_kind == "sandbox"
    assert "step '02-overrides': setup.sh exited with 3" in (result.error or "")
    assert "no overrides" in (result.error or "")


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("agent", ["mini-swe-agent", "opencode"])
async def test_real_agents_work_through_the_steps_on_the_docker_backend(
    runtime_for: Callable[[Replies], Any], agent: str
) -> None:
    task = load_task(TASK, split="steps")
    runtime = await runtime_for(
        [*replay(agent, solve(task, 0)), *replay(agent, solve(task, 1)), *give_up(agent)]
    )
    options = RolloutOptions(harness=agent, sandbox="docker", agent_timeout_sec=300)
    assert_solved(await runtime.rollout(task, options), agent)
    assert_stopped_after_the_first_step(await runtime.rollout(task, options))


async def test_each_step_can_be_verified_in_a_sandbox_of_its_own(
    runtime_for: Callable[[Replies], Any], tmp_path: Path
) -> None:
    """The task made separate (``[verifier] environment_mode``, its one artifact the env file): each step's
    verifier starts a fresh sandbox of the task's environment with the task's and the step's tests copied
    in, and sees the agent's work only through the artifact; the steps still build on each other."""
    folder = for_the_local_sandbox(TASK, tmp_path)
    toml = (
        (folder / "task.toml")
        .read_text()
        .replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n')
    )
    (folder / "task.toml").write_text('artifacts = ["/app/service.env"]\n' + toml)
    task = load_task(folder, split="steps")
    assert all(step.separate_verifier is not None for step in task.steps)
    runtime = await runtime_for([*replay("toy", solve(task, 0)), *replay("toy", solve(task, 1))])
    result = await runtime.rollout(
        task, RolloutOptions(harness="toy", sandbox="local", agent_timeout_sec=120)
    )
    assert_solved(result, "toy")


def test_a_white_box_episode_refuses_a_multi_step_task_naming_it(tmp_path: Path) -> None:
    """A white-box episode is one instruction and one verdict: the server answers 400 with this."""
    from harness_trainer.rollouts.result import EnvironmentOptions
    from harness_trainer.rollouts.server.environment import Environment
    from harness_trainer.sandboxes import LocalSandboxBackend

    task = load_task(TASK, split="steps")
    with pytest.raises(ValueError, match="service-env-export is a multi-step task \\(2 steps\\)"):
        Environment(task, EnvironmentOptions(), LocalSandboxBackend(tmp_path))
