"""A whole rollout in a Docker container: the toy agent (run by the container's python3) reaches the capture
proxy on this machine's loopback through the backend's relay, solves the task, and the verifier scores it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness_trainer.net import free_port
from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from tests.rollouts.conftest import EXAMPLES, bash_call

ROOT = Path(__file__).resolve().parents[2]

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


def _dataset(root: Path, dockerfiles: dict[str, str]) -> Path:
    for name, dockerfile in dockerfiles.items():
        task = root / "train" / name
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "task.toml").write_text('version = "1.0"\n')
        (task / "instruction.md").write_text("Do nothing.\n")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    return root


def test_serve_prepare_builds_every_environment_first_and_a_broken_one_stops_it_naming_it(
    tmp_path: Path,
) -> None:
    """A run whose environment cannot be built learns it when serve starts, in seconds, not at its first
    group of rollouts."""
    base = [sys.executable, "-m", "harness_trainer.cli", "serve", "--upstream", "http://127.0.0.1:9"]
    base += ["--served-model", "m", "--data-dir", str(tmp_path / "capture"), "--proxy", "in-process"]
    good = "FROM ubuntu:24.04\nRUN echo ok > /ok.txt\n"
    bad = "FROM ubuntu:24.04\nRUN echo no-$((6 * 7)); exit 9\n"
    broken = _dataset(tmp_path / "broken", {"fine": good, "broken-env": bad})
    argv = [*base, "--dataset", str(broken), "--prepare", "train", "--prepare-sandbox", "docker"]
    argv += ["--port", str(free_port()), "--capture-port", str(free_port())]
    failed = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert failed.returncode == 2, failed.stderr[-3000:]
    err = failed.stderr
    assert "error: 1 of 2 environments could not be prepared on docker" in err
    assert "broken-env: broken-env: the image build failed" in err and "no-42" in err
    ready = _dataset(tmp_path / "ready", {"fine": good})
    port = free_port()
    serving = subprocess.Popen(
        [*base, "--dataset", str(ready), "--prepare", "train", "--prepare-sandbox", "docker",
         "--port", str(port), "--capture-port", str(free_port())],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert serving.poll() is None and time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(60) == 0
        assert serving.stderr is not None
        assert "prepared 1 environments of train on docker" in serving.stderr.read()
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()
        if serving.stderr is not None:
            serving.stderr.close()


@pytest.mark.slow
def test_serve_prepare_stops_at_start_naming_an_agent_whose_bundle_cannot_be_built(tmp_path: Path) -> None:
    """The npm registry down: serve fails in seconds with one error naming the agent and what failed, before
    any rollout (the bundle is built before any environment)."""
    dataset = _dataset(tmp_path / "data", {"fine": "FROM ubuntu:24.04\n"})
    argv = [sys.executable, "-m", "harness_trainer.cli", "serve", "--upstream", "http://127.0.0.1:9"]
    argv += ["--served-model", "m", "--data-dir", str(tmp_path / "capture"), "--proxy", "in-process"]
    argv += ["--dataset", str(dataset), "--prepare", "train", "--prepare-sandbox", "docker"]
    argv += ["--prepare-harness", "opencode", "--port", str(free_port()), "--capture-port", str(free_port())]
    environ = {**os.environ, "HARNESS_TRAINER_CACHE": str(tmp_path / "cache")}
    environ["NPM_CONFIG_REGISTRY"] = "http://127.0.0.1:9"
    failed = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=environ)
    assert failed.returncode == 2, failed.stderr[-3000:]
    expected = "error: the opencode agent could not be prepared: cannot fetch opencode-linux-x64@1.18.33 from"
    assert f"{expected} the npm registry http://127.0.0.1:9" in failed.stderr
    assert "prepared" not in failed.stderr.replace("could not be prepared", "")
