"""A docker-compose task on the Docker backend: the agent's container (``main``, the task's own image) and a
sidecar built from the task's ``environment/api`` (``FROM python:3.12-slim``, stood in for by the local
base with Python) on a network of the sandbox's own, ``internal`` since the task has ``allow_internet =
false``: the agent reaches the sidecar by its service name and the capture proxy through its relay, and
nothing else. Real mini-swe-agent replays the solution (it reads the stock from the sidecar: reward 1),
then gives up (reward 0). Every container and network the sandboxes made is gone afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness_trainer.net import free_port
from harness_trainer.rollouts.result import RolloutOptions
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.sandboxes.docker_daemon import LABEL, RUN_ID
from harness_trainer.tasks.loader import load_task
from tests.conftest import EngineProcess
from tests.rollouts.test_multi_step import Replies, give_up, replay

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

TASK = Path(__file__).resolve().parents[1] / "harbor_shaped" / "compose" / "restock-report"


def ours(client: object, kind: str) -> list[str]:
    """This process's containers or networks on the daemon (by the run's label)."""
    found = getattr(client, kind).list(filters={"label": f"{LABEL}={RUN_ID}"})
    return [item.name for item in found if kind != "networks" or item.name.startswith("ht-")]


async def test_the_agent_reaches_its_sidecar_by_name_and_everything_is_removed_after(
    scripted_engine: Callable[[Replies], EngineProcess], tmp_path: Path
) -> None:
    import docker

    task = load_task(TASK, split="compose")
    solve = (TASK / "solution" / "solve.sh").read_text()
    engine = scripted_engine([*replay("mini-swe-agent", solve), *give_up("mini-swe-agent")])
    config = RuntimeConfig(upstream=engine.url, data_dir=tmp_path / "capture", capture_port=free_port())
    runtime = RolloutRuntime(config)
    await runtime.start()
    client = docker.from_env()
    try:
        assert await runtime.prepare([task], "docker", harnesses=["mini-swe-agent"]) == 1
        options = RolloutOptions(harness="mini-swe-agent", sandbox="docker", agent_timeout_sec=300)
        solved = await runtime.rollout(task, options)
        assert solved.error is None and solved.reward == 1.0, (solved.error, solved.log_tail[-3000:])
        gave_up = await runtime.rollout(task, options)
        assert gave_up.error is None and gave_up.reward == 0.0
        assert ours(client, "containers") == [] and ours(client, "networks") == []
    finally:
        await runtime.aclose()
        client.close()
