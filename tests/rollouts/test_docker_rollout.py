"""A whole rollout in a Docker container: the toy agent (run by the container's python3) reaches the capture
proxy on this machine's loopback through the backend's relay, solves the task, and the verifier scores it."""

from __future__ import annotations

import pytest

from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from tests.rollouts.conftest import EXAMPLES, bash_call

pytestmark = pytest.mark.docker

# /.dockerenv exists only in a Docker container: the task is solved only if the command ran in one.
SOLVE = "test -f /.dockerenv && printf 'Hello, Harbor!\\n' > /app/hello.txt"
HELLO = [bash_call(SOLVE), {"content": "Done."}]


def test_the_toy_agent_solves_a_task_in_a_docker_container(scripted_engine) -> None:
    engine = scripted_engine(HELLO)
    with LocalSessionFactory(str(EXAMPLES), upstream=engine.url, harness="toy", sandbox="docker") as factory:
        row = next(r for r in factory.prompt_rows() if r["task_name"] == "hello-file")
        session = factory.create(row, episode_id="docker")
        assert session.wait_for_completion(timeout_s=120) == 0
        trace = session.fetch_training_trace()
        verified = session.verify([])
        session.close()
        assert factory.open_capture_sessions() == 0
    assert verified.env_reward == 1.0
    assert verified.metrics["tool_calls_by_name"] == {"bash": 1}
    assert len(trace.turns) == 2
