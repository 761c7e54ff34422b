"""The capture proxy SIGKILLed mid-run and restarted on the same port and data dir, under a real run.

Here the proxy is its own process (``python -m capture_proxy``) and the rollout server (``harness-trainer
serve --capture-url``) uses it without owning it; the trainer talks to the server through
``HarborSessionFactory``, as in production.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.net import free_port
from harness_trainer.rollouts.client.factory import HarborSession, HarborSessionFactory
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from tests.hardening.faults import (
    SOLVE_CMD,
    ProxyProcess,
    ServeProcess,
    answered_steps,
    descendants,
    describe,
    metrics_lines,
    training_config,
    wait_until,
)
from tests.rollouts.conftest import EXAMPLES, bash_call, scripted_engine  # noqa: F401

pytestmark = pytest.mark.slow
ADMIN_KEY = "hardening-admin-key"


class RecordingHarborFactory(HarborSessionFactory):
    """``HarborSessionFactory`` that keeps its sessions, so the test can read each rollout's result."""

    def __init__(self, *args: Any, made: list[HarborSession], **options: Any) -> None:
        super().__init__(*args, **options)
        self.made = made

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborSession:
        session = super().create(task, seed=seed, episode_id=episode_id)
        self.made.append(session)
        return session


def test_a_proxy_killed_mid_run_and_restarted_loses_no_answered_call_and_fails_nothing_silently(
    scripted_engine,  # noqa: F811
    tiny_model_dir,
    tmp_path,
) -> None:
    """The proxy is SIGKILLed twice while an agent of group 0 sits in a 20 s tool call after its first
    answer. First it is restarted at once (20 s leaves a loaded CI machine time to start it; 4, 6 and 10 s
    did not always): the agent's session, reloaded from its journal, goes on, and its trace holds both
    calls. Then it stays down for 24 s: the agent's next call fails (the toy agent gives up), and the
    rollout's export waits for the restarted proxy and yields the one answered call. For every rollout,
    the trace holds exactly the calls its agent got an answer for (counted from the agent's own log); the
    run trains its 2 steps; no capture session, agent or sandbox is left."""
    slow, fast = bash_call(f"{SOLVE_CMD}; sleep 20"), bash_call(SOLVE_CMD)
    engine = scripted_engine([slow, fast, slow] + [fast] * 40)
    data = tmp_path / "capture"
    proxy = ProxyProcess(engine.url, data, free_port(), ADMIN_KEY, tmp_path / "proxy.log")
    tasks = tmp_path / "tasks"
    shutil.copytree(EXAMPLES / "train" / "hello-file", tasks / "train" / "hello-file")
    port = free_port()
    serve = ServeProcess(
        [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(tasks), "--upstream",
         engine.url, "--port", str(port), "--capture-url", proxy.url, "--capture-admin-key", ADMIN_KEY,
         "--data-dir", str(tmp_path / "unused"), "--max-concurrent-envs", "4"],
        tmp_path / "serve.log", f"http://127.0.0.1:{port}",
    )  # fmt: skip
    made: list[HarborSession] = []
    killed: list[str] = []  # the session each kill hit
    errors: list[BaseException] = []

    def first_answered_session(skip: list[str]) -> str | None:
        for journal in (data / "sessions").glob("*/calls.jsonl"):
            session = journal.parent.name
            if session not in skip and journal.exists() and journal.read_bytes().count(b"\n") >= 1:
                return session
        return None

    def kill_twice() -> None:
        try:
            for downtime in (0.0, 24.0):
                assert wait_until(lambda: first_answered_session(killed) is not None, 120), "no agent call"
                killed.append(first_answered_session(killed) or "")
                # The proxy journals a call before it answers: killing at once could take the answer with
                # it. 1.5 s in, the agent has it and sits in its 20 s tool call.
                threading.Event().wait(1.5)
                proxy.kill()
                # The fault itself: how long the proxy stays dead (the agent's 20 s tool call is between).
                threading.Event().wait(downtime)
                proxy.start()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    proxy.start()
    try:
        serve.start()
        assert serve.process is not None
        builder = partial(
            RecordingHarborFactory, serve.url, split="train", harness="toy", sandbox="local",
            agent_timeout_sec=60, agent_step_limit=2, made=made,
        )  # fmt: skip
        trainer = HarnessAsyncGRPOTrainer(
            str(tiny_model_dir), builder, training_config(tmp_path / "out", engine.url)
        )
        killer = threading.Thread(target=kill_twice, daemon=True)
        killer.start()
        trainer.train()
        killer.join(60)
        assert not errors, errors
        assert proxy.starts == 3 and len(killed) == 2

        assert [line["step"] for line in metrics_lines(tmp_path / "out")] == [1, 2]
        results = {s.result.capture_session_id: s.result for s in made if s.result is not None}
        resumed, cut = results[killed[0]], results[killed[1]]
        assert resumed.error is None and answered_steps(resumed.log_tail) == 2
        assert resumed.trace is not None and len(resumed.trace["turns"]) == 2
        assert cut.error is None and '"error"' in cut.log_tail and answered_steps(cut.log_tail) == 1
        assert cut.trace is not None and len(cut.trace["turns"]) == 1
        for result in results.values():
            if result.error == "cancelled":  # the group admitted after the last step, stopped with the run
                continue
            assert result.error is None and result.trace is not None, result.error
            assert len(result.trace["turns"]) == answered_steps(result.log_tail), result.log_tail
        assert wait_until(lambda: proxy.open_sessions() == [], 30), proxy.open_sessions()
        health = httpx.get(serve.url + "/health", timeout=10).json()
        assert health["capture_sessions"] == 0 and health["sessions"] <= 1
        agents = [pid for pid in descendants(serve.process.pid) if "toy_agent" in " ".join(describe({pid}))]
        assert agents == []
    finally:
        serve.stop()
        proxy.stop()
    assert serve.process is not None and serve.process.returncode is not None
    assert list((data / "sessions").iterdir()) == []


def test_the_runtime_uses_an_external_proxy_without_starting_or_stopping_it(
    scripted_engine,  # noqa: F811
    tmp_path,
) -> None:
    """``RuntimeConfig(capture_url=…)``: the runtime mints sessions on the running proxy, binds no port
    of its own, and leaves the proxy running after ``aclose``; without the admin key it refuses."""
    import asyncio

    engine = scripted_engine([{"content": "hi"}])
    proxy = ProxyProcess(engine.url, tmp_path / "capture", free_port(), ADMIN_KEY, tmp_path / "proxy.log")
    proxy.start()
    try:
        with pytest.raises(ValueError, match="admin key"):
            RolloutRuntime(RuntimeConfig(upstream=engine.url, data_dir=tmp_path, capture_url=proxy.url))

        async def use() -> tuple[str, str]:
            config = RuntimeConfig(
                upstream=engine.url, data_dir=tmp_path / "unused", capture_url=proxy.url + "/",
                admin_key=ADMIN_KEY, capture_port=1,
            )  # fmt: skip
            runtime = RolloutRuntime(config)
            await runtime.start()
            assert runtime.capture is not None
            minted = await runtime.capture.mint(None, None, {"task": "t"})
            await runtime.capture.delete(minted.session_id)
            await runtime.aclose()
            return runtime.model, minted.root_url

        model, root_url = asyncio.run(use())
        assert model == "tiny" and root_url == proxy.url
        assert proxy.process is not None and proxy.process.poll() is None
        assert proxy.open_sessions() == []
        assert not (tmp_path / "unused").exists()
    finally:
        proxy.stop()


def test_serve_refuses_an_external_proxy_without_its_admin_key(tmp_path) -> None:
    """``serve --capture-url`` without ``--capture-admin-key`` (or the env variable) exits 2, saying why."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "CAPTURE_PROXY_ADMIN_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(EXAMPLES), "--upstream",
         "http://127.0.0.1:9", "--capture-url", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=env, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 2 and "admin key" in done.stderr
