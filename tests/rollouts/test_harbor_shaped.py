"""Every supported agent on tasks shaped like real Harbor datasets, through ``harness-trainer serve`` on the
Docker backend, and through the rollout runtime in the fake E2B cloud (which runs each template's own
filesystem, not this machine's).

The tasks (``tests/harbor_shaped/test``, written here) are what Terminal-Bench-style datasets hold: schema
2.0 ``task.toml`` with resource fields, a Dockerfile ``FROM`` a digest-pinned ``python:3.12-slim``,
``debian:bookworm-slim`` or ``ubuntu:24.04`` (the pins are of our own making: no registry is reachable
here, so each ``FROM`` is stood in for by the local base, as for any user without one), apt and pip
installs at build time, several files under ``/app``, a pytest verifier writing ``reward.txt``; one has
``allow_internet = false``. None of their images has Node.

``serve --prepare test --prepare-harness …`` builds every image and every agent's bundle, and sets the pip
agents (mini-swe-agent, aider) up for each image's Python, before it answers. Then each real agent
(:data:`AGENTS`) replays one task's ``solution/solve.sh`` (the tasks in turn, so each is solved by several
agents) through its own shell tool (aider, which has none, runs it as the fenced shell block of a text
reply), driven by the scripted dev engine (reward 1), and gives up at once on one task (reward 0). Asserted besides: no image has ``node`` or ``npm``; every
rollout's agent ran from its provisioned bundle (no per-rollout install); the agents that keep their own
record of their model calls agree with the capture; nothing is left open. The E2B run does the same with
the templates carrying the bundles as their last layers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.devloop.prompts import dev_harness_options
from harness_trainer.devloop.solver import command_replies
from harness_trainer.harnesses.mini_swe_agent import SUBMIT_COMMAND
from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.rollouts.agreement import Agreement
from harness_trainer.rollouts.client.factory import HarborSessionFactory
from harness_trainer.rollouts.result import RolloutOptions
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.tasks.sources import open_task_source
from tests.sandboxes.fake_e2b import FakeE2BCloud

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "tests" / "harbor_shaped"
TASKS = sorted(path.name for path in (DATASET / "test").iterdir())
AGENTS = ("mini-swe-agent", "opencode", "claude-code", "codex", "pi", "qwen-code", "gemini-cli", "aider")
RECORDING_AGENTS = tuple(agent for agent in AGENTS if agent != "aider")
"""The agents whose own record of their model calls is read and checked against the capture (aider keeps
none this project reads)."""
NODE_PROBE = "command -v node || command -v npm"
GIVE_UP = "service-error-summary"  # the no-op's task (allow_internet = false)


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def replay(agent: str, command: str) -> list[dict[str, Any]]:
    """The replies with which ``agent`` runs ``command`` in its shell tool, then ends its run (its
    harness's scripted dialect, as the dev loop's solver transcripts)."""
    return command_replies(agent, command)


def give_up(agent: str) -> list[dict[str, Any]]:
    """The replies with which ``agent`` ends its run without doing anything."""
    if agent == "mini-swe-agent":
        return [call("bash", command=SUBMIT_COMMAND)]
    return [{"content": "I will not change anything."}]


def expected_agreement(agent: str, calls: int) -> Agreement:
    """Every recording agent's own record (mini-swe-agent's trajectory, pi's run log, opencode's session
    export, claude-code's transcript, codex's rollout file, qwen-code's request logs, gemini-cli's chat
    recording) holds every call, which the capture must have seen as sent."""
    if agent in RECORDING_AGENTS:
        return Agreement(status="match", agent_calls=calls, captured_calls=calls)
    return Agreement(status="not_available", captured_calls=calls)


def replays() -> tuple[list[dict[str, Any]], list[tuple[str, str, float]]]:
    """The scripted engine's replies, and the rollouts that consume them in order: ``(agent, task,
    expected reward)``."""
    script: list[dict[str, Any]] = []
    plan: list[tuple[str, str, float]] = []
    for index, agent in enumerate(AGENTS):
        # One task solved per agent, in turn: every task is solved by several agents on each backend, and the
        # suite does not pay for agents x tasks rollouts twice (each is ~25 s of real agent).
        task = TASKS[index % len(TASKS)]
        script += replay(agent, (DATASET / "test" / task / "solution" / "solve.sh").read_text())
        plan.append((agent, task, 1.0))
        script += give_up(agent)
        plan.append((agent, GIVE_UP, 0.0))
    return script, plan


def test_every_agent_solves_harbor_shaped_tasks_in_images_without_node(
    scripted_engine: Any, tmp_path: Path
) -> None:
    script, plan = replays()
    engine = scripted_engine(script)

    port = free_port()
    command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(DATASET)]
    command += ["--upstream", engine.url, "--port", str(port), "--capture-port", str(free_port())]
    command += ["--data-dir", str(tmp_path / "capture"), "--prepare", "test", "--prepare-sandbox", "docker"]
    for agent in AGENTS:
        command += ["--prepare-harness", agent]
    environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server, timeout=1500)
        assert _images_with_node() == []
        for agent, task, reward in plan:
            factory = HarborSessionFactory(
                url, split="test", harness=agent, sandbox="docker", agent_timeout_sec=300,
                harness_options=dev_harness_options(agent),  # the tiny context: some agents, shell alone
            )  # fmt: skip
            try:
                row = next(r for r in factory.prompt_rows() if r["task_name"] == task)
                session = factory.create(row["prompt"])
                try:
                    session.wait_for_completion()
                    result = session.result
                    assert result is not None and result.error is None, (agent, task, result)
                    assert result.reward == reward, (agent, task, result.log_tail[-6000:])
                    assert result.model_calls == len(replay(agent, "x") if reward else give_up(agent))
                    assert result.agreement == expected_agreement(agent, result.model_calls), (agent, task)
                finally:
                    session.close()
            finally:
                factory.close()
        served = (tmp_path / "serve.log").read_text()
        assert "not provisioned in sandbox" not in served  # no rollout fell back to a network install
        assert "prepared 3 environments of test on docker" in served
    finally:
        server.terminate()
        try:
            server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            log.close()
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-5000:]


def _images_with_node() -> list[str]:
    """The task images (labelled by the docker backend) in which ``node`` or ``npm`` is a command."""
    listed = subprocess.run(
        ["docker", "images", "--filter", "label=harness-trainer=env", "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    found = []
    for image in listed:
        probe = [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            image,
            "sh",
            "-c",
            "command -v node || command -v npm",
        ]
        if subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
            found.append(image)
    return found


async def test_every_agent_solves_harbor_shaped_tasks_in_the_fake_e2b_cloud(
    scripted_engine: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script, plan = replays()
    engine = scripted_engine(script)
    source = open_task_source(str(DATASET))
    tasks = {task.name: task for task in source.tasks("test")}
    with tempfile.TemporaryDirectory(prefix="ht-harbor-e2b-", dir="/var/tmp") as scratch:
        cloud = FakeE2BCloud(Path(scratch) / "cloud")
        e2b = {"sandbox_class": cloud, "template_class": cloud.template_class, "build_log_dir": Path(scratch)}
        config = RuntimeConfig(
            upstream=engine.url, data_dir=tmp_path / "capture", capture_port=free_port(),
            sandbox_options={"e2b": e2b},
        )  # fmt: skip
        runtime = RolloutRuntime(config)
        await runtime.start()
        try:
            assert await runtime.prepare(list(tasks.values()), "e2b", harnesses=AGENTS) == len(TASKS)
            for agent, task, reward in plan:
                options = RolloutOptions(
                    harness=agent,
                    sandbox="e2b",
                    agent_timeout_sec=300,
                    harness_options=dev_harness_options(agent),
                )
                result = await runtime.rollout(tasks[task], options)
                assert result.error is None and result.reward == reward, (
                    agent,
                    task,
                    result.log_tail[-3000:],
                )
                assert result.agreement == expected_agreement(agent, result.model_calls), (agent, task)
            assert await runtime.open_capture_sessions() == 0
        finally:
            await runtime.aclose()
        assert all(sandbox.killed for sandbox in cloud.sandboxes)
        assert len(cloud.template_class.builds) == len(TASKS)  # one template each, agents in it
    assert "not provisioned in sandbox" not in caplog.text


async def test_preparing_a_remote_backend_stops_when_its_sandboxes_cannot_reach_the_proxy(
    tmp_path: Path,
) -> None:
    """The public URL agents would be told leads nowhere: preparation says so, in seconds, before any
    rollout (the fake E2B cloud's sandboxes share this machine's network, so a closed port stands in)."""
    task = open_task_source(str(DATASET)).tasks("test")[0]
    cloud = FakeE2BCloud(tmp_path / "cloud")
    e2b = {"sandbox_class": cloud, "template_class": cloud.template_class, "build_log_dir": tmp_path}
    nowhere = f"http://127.0.0.1:{free_port()}"
    config = RuntimeConfig(
        upstream="http://127.0.0.1:9", served_model="m", data_dir=tmp_path / "capture",
        capture_port=free_port(), public_url=nowhere, sandbox_options={"e2b": e2b},
    )  # fmt: skip
    runtime = RolloutRuntime(config)
    await runtime.start()
    try:
        with pytest.raises(SandboxStartError, match=f"cannot reach the capture proxy at {nowhere}/health"):
            await runtime.prepare([task], "e2b")
    finally:
        await runtime.aclose()
    assert all(sandbox.killed for sandbox in cloud.sandboxes) and cloud.sandboxes
