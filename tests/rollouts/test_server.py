"""The rollout server as a real process (``harness-trainer serve``), driven by ``HarborSessionFactory``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.rollouts.client.factory import HarborSessionFactory, RolloutServerError
from harness_trainer.rollouts.errors import RolloutConfigError
from tests.rollouts.conftest import EXAMPLES, bash_call, live_sandbox_processes

HELLO = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]


class Server:
    def __init__(self, engine_url: str, data_dir: Path, limit: int = 3) -> None:
        self.port, self.capture_port = free_port(), free_port()
        command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(EXAMPLES)]
        command += [
            "--upstream",
            engine_url,
            "--port",
            str(self.port),
            "--capture-port",
            str(self.capture_port),
        ]
        command += ["--data-dir", str(data_dir), "--max-concurrent-envs", str(limit)]
        environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
        self.process = subprocess.Popen(command, env=environ)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_until_healthy(self.url, self.process)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def server(scripted_engine, tmp_path: Path) -> Iterator[Server]:
    running = Server(scripted_engine(HELLO).url, tmp_path / "capture")
    yield running
    running.stop()
    assert running.process.returncode is not None


def builder(server: Server, **options: object) -> HarborSessionFactory:
    return HarborSessionFactory(server.url, split="train", harness="toy", sandbox="local", **options)


@pytest.mark.slow
def test_a_factory_in_another_process_runs_a_rollout_through_the_server(server: Server) -> None:
    factory = pickle.loads(
        pickle.dumps(builder(server, sampling={"temperature": 1.0}, agent_timeout_sec=120))
    )
    rows = factory.prompt_rows()
    assert {row["task_name"] for row in rows} >= {"hello-file", "fix-calc-bug"}
    session = factory.create(next(row for row in rows if row["task_name"] == "hello-file")["prompt"])
    assert session.wait_for_completion(timeout_s=120) == 0
    trace = session.fetch_training_trace()
    assert len(trace.turns) == 2 and trace.turns[1].metadata["parent"] == trace.turns[0].node_id
    assert session.verify([]).env_reward == 1.0
    session.close()
    session.close()
    factory.close()
    health = httpx.get(server.url + "/health").json()
    assert health["sessions"] == 0 and health["capture_sessions"] == 0
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_a_full_server_answers_429_and_says_how_to_size_it(server: Server) -> None:
    factory = builder(server)
    factory.tasks()  # the metadata session takes one of the three slots
    sessions = [factory.request("POST", "/sessions")["session_id"] for _ in range(2)]
    with pytest.raises(RolloutServerError, match=r"429.*MAX_CONCURRENT_ENVS"):
        factory.create(0)
    for session_id in sessions:
        factory.request("DELETE", f"/sessions/{session_id}")
    factory.close()


@pytest.mark.slow
def test_bad_requests_get_clear_errors(server: Server) -> None:
    session_id = httpx.post(server.url + "/sessions").json()["session_id"]
    missing = httpx.post(f"{server.url}/sessions/{session_id}/rollout", json={"split": "train", "index": 99})
    assert missing.status_code == 404 and "no such task" in missing.json()["error"]["message"]
    bad = httpx.post(
        f"{server.url}/sessions/{session_id}/rollout", json={"split": "train", "index": 0, "bogus": 1}
    )
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
    for sandbox, says in [("nope", "known: docker, e2b, hf, local"), ("e2b", "needs E2B_API_KEY")]:
        refused = httpx.post(
            f"{server.url}/sessions/{session_id}/rollout",
            json={"split": "train", "index": 0, "sandbox": sandbox},
        )
        assert refused.status_code == 400 and says in refused.json()["error"]["message"]
    for options, says in [({"bogus": 1}, "take options ['bogus']"), ({"agent_config": 3}, "mapping")]:
        refused = httpx.post(
            f"{server.url}/sessions/{session_id}/rollout",
            json={"split": "train", "index": 0, "harness": "mini-swe-agent", "harness_options": options},
        )
        assert refused.status_code == 400 and says in refused.json()["error"]["message"]
    with pytest.raises(RolloutConfigError, match="does not take options"):  # refused before any request
        HarborSessionFactory(server.url, harness="toy", harness_options={"bogus": 1})
    assert httpx.get(server.url + "/splits/nope/tasks").status_code == 404
    assert httpx.get(f"{server.url}/sessions/{session_id}/trace").status_code == 409
    assert httpx.delete(f"{server.url}/sessions/{session_id}").status_code == 200
    assert httpx.get(f"{server.url}/sessions/{session_id}").status_code == 404


@pytest.mark.slow
def test_a_server_restart_gives_open_sessions_a_clear_error_not_a_hang(
    scripted_engine, tmp_path: Path
) -> None:
    engine = scripted_engine([bash_call("sleep 60"), {"content": "never"}])
    first = Server(engine.url, tmp_path / "a")
    try:
        factory = HarborSessionFactory(
            first.url, split="train", harness="toy", sandbox="local", request_timeout_s=5
        )
        session = factory.create(0)
        first.stop()
        with pytest.raises(RolloutServerError, match="unreachable"):
            session.wait_for_completion(timeout_s=30)
        session.close()
        factory.close()
    finally:
        first.stop()
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_a_policy_set_through_the_factory_reaches_the_capture_proxy(server: Server) -> None:
    factory = builder(server, agent_timeout_sec=120)
    factory.set_policy("tiny", 4)  # the name the dev engine serves; each later call goes there
    bad = httpx.put(server.url + "/policy", json={"model": "", "version": 1})
    assert bad.status_code == 400 and "model" in bad.json()["error"]["message"]
    with pytest.raises(RolloutServerError, match="400"):
        factory.set_policy("tiny", -1)
    factory.set_policy_version(5)  # a version only (weights pushed in place): calls keep their model
    session = factory.create(
        next(r for r in factory.prompt_rows() if r["task_name"] == "hello-file")["prompt"]
    )
    assert session.wait_for_completion(timeout_s=120) == 0
    turns = session.fetch_training_trace().turns
    assert len(turns) == 2
    assert [turn.metadata["dispatch_version"] for turn in turns] == [5, 5]
    session.close()
    factory.close()
