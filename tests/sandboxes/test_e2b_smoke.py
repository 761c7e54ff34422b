"""``harness-trainer e2b smoke``, run in-process against the fake E2B cloud (the CI cannot reach E2B) and a
real dev engine on loopback. The fake's sandboxes share this host's network, so the capture proxy's
loopback URL stands in for the public one a real run gets from a tunnel.

The full run goes through every phase for real: the fake cloud builds the task's template, the harness is
installed inside the sandbox, the agent solves ``sum-numbers`` with scripted replies through the capture
proxy, and the task's verifier gives the reward. It runs the toy harness: the command's default,
mini-swe-agent, would pip-install a 754 MB venv inside the fake sandbox (its ``/root`` is its own, so the
host's tool cache is not reused), about 5 minutes of CI per run for a path that is the same for every
harness; mini-swe-agent itself is tested through the capture proxy in ``tests/harnesses``.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.cli import build_parser
from harness_trainer.dev_engine.process import EngineProcess
from harness_trainer.examples import TASKS as EXAMPLES
from harness_trainer.launch.e2b_commands import _e2b_smoke
from harness_trainer.net import free_port
from tests.rollouts.conftest import scripted_engine  # noqa: F401 - the fixture
from tests.sandboxes.conftest import TaskFactory, wait_until_present
from tests.sandboxes.fake_e2b import FakeE2BCloud

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon

PHASES = ("template", "session", "create", "install", "agent", "upload", "verifier", "trace", "cleanup")


def bash(command: str, content: str = "") -> dict[str, Any]:
    """A scripted assistant reply that calls the ``bash`` tool once."""
    call = {"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
    return {"content": content, "tool_calls": [call]}


# What the toy agent's model would write to solve test/sum-numbers.
SUM_NUMBERS = [
    bash("cat /app/numbers.txt", "Let me see the numbers."),
    bash("awk '{s += $1} END {print s}' /app/numbers.txt > /app/sum.txt"),
    {"content": "Done."},
]


@pytest.fixture
def cloud(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeE2BCloud:
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    return FakeE2BCloud(tmp_path / "e2b")


def smoke_args(task: Path, engine_url: str, port: int, *extra: str) -> Any:
    argv = ["e2b", "smoke", "--task", str(task), "--engine-url", engine_url, "--proxy-port", str(port)]
    return build_parser().parse_args([*argv, "--proxy-public-url", f"http://127.0.0.1:{port}", *extra])


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def phase_seconds(out: str) -> dict[str, float]:
    """``{phase: seconds}`` from the command's phase lines (``name   12.34 s  note``)."""
    found = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] in PHASES and words[2] == "s":
            found[words[0]] = float(words[1])
    return found


def test_smoke_runs_mini_swe_agent_by_default() -> None:
    args = build_parser().parse_args(["e2b", "smoke", "--task", "t", "--engine-url", "http://e"])
    assert args.harness == "mini-swe-agent"


@pytest.mark.slow
def test_smoke_runs_an_agent_through_the_proxy_and_prints_every_phase_then_cleans_up(
    cloud: FakeE2BCloud,
    scripted_engine: Callable[[list[dict[str, Any]]], EngineProcess],  # noqa: F811 - the imported fixture
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine, port = scripted_engine(SUM_NUMBERS), free_port()
    status = _e2b_smoke(
        smoke_args(EXAMPLES / "test/sum-numbers", engine.url, port, "--harness", "toy"),
        cloud,
        cloud.template_class,
    )
    out = capsys.readouterr().out
    print(out)  # the phase times, in the test's log
    assert status == 0, out
    assert set(phase_seconds(out)) == set(PHASES), out
    lines = out.splitlines()
    assert "harness toy, model tiny" in lines[0]
    assert next(line for line in lines if line.startswith("template")).split()[3] == "built"
    assert "reward 1.0 (reward.txt)" in lines and "turns 3" in lines and lines[-1] == "ok"
    assert len(cloud.sandboxes) == 1 and cloud.sandboxes[0].killed  # the sandbox is gone from the account
    assert not listening(port)  # the capture proxy is stopped


def test_smoke_without_an_e2b_key_says_so_and_exits_2_before_any_cloud_call(
    cloud: FakeE2BCloud, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY")
    port = free_port()
    args = smoke_args(EXAMPLES / "test/sum-numbers", "http://127.0.0.1:9", port)
    assert _e2b_smoke(args, cloud, cloud.template_class) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "E2B_API_KEY" in captured.err
    assert cloud.create_calls == [] and cloud.list_calls == [] and cloud.template_class.exists_calls == []
    assert not listening(port)


def test_smoke_in_the_real_cloud_refuses_a_loopback_proxy_url_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    port = free_port()
    args = smoke_args(EXAMPLES / "test/sum-numbers", "http://127.0.0.1:9", port)
    assert _e2b_smoke(args) == 2  # the real SDK: its sandboxes cannot reach this machine's loopback
    assert "cannot reach" in capsys.readouterr().out and not listening(port)


@pytest.mark.slow
def test_smoke_fails_naming_the_reason_when_the_verifier_writes_no_reward(
    cloud: FakeE2BCloud, engine: EngineProcess, make_task: TaskFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    task = make_task("FROM python:3.11-slim\nWORKDIR /app\n")
    (task.path / "tests/test.sh").write_text("#!/bin/bash\necho 'no reward file'\n")
    port = free_port()
    status = _e2b_smoke(
        smoke_args(task.path, engine.url, port, "--harness", "toy"), cloud, cloud.template_class
    )
    out = capsys.readouterr().out
    assert status == 1, out
    assert set(phase_seconds(out)) == set(PHASES), out
    assert out.splitlines()[-1] == "FAIL: the verifier produced no reward: the verifier wrote no reward"
    assert all(sandbox.killed for sandbox in cloud.sandboxes) and not listening(port)


@pytest.mark.slow
def test_ctrl_c_during_the_agent_kills_the_sandbox_and_stops_the_proxy(
    cloud: FakeE2BCloud,
    scripted_engine: Callable[[list[dict[str, Any]]], EngineProcess],  # noqa: F811 - the imported fixture
    make_task: TaskFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A sleep no other test runs: the wait below looks for it among every process on the machine.
    engine, port = scripted_engine([bash("sleep 67")]), free_port()
    task = make_task("FROM python:3.11-slim\nWORKDIR /app\n")

    def interrupt_once_the_agent_sleeps() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # as the kernel picks (test_signals)
        wait_until_present("sleep 67", timeout_s=120)  # the toy agent's bash tool, in the fake sandbox
        # As Ctrl-C, delivered to this thread, not the main one: the kernel may hand a process-directed
        # SIGINT to any thread, and the smoke test must still cancel at once (harness_trainer/signals.py).
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_the_agent_sleeps)
    interrupter.start()
    started = time.monotonic()
    try:
        status = _e2b_smoke(
            smoke_args(task.path, engine.url, port, "--harness", "toy"), cloud, cloud.template_class
        )
    finally:
        interrupter.join()
    out = capsys.readouterr().out
    assert status == 130, out
    assert time.monotonic() - started < 50  # not the agent's 67 s sleep
    assert "interrupted" in out.splitlines()[-1]
    assert len(cloud.sandboxes) == 1 and cloud.sandboxes[0].killed and not listening(port)


def test_sandbox_only_checks_one_sandbox_and_closes_it(
    cloud: FakeE2BCloud, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["e2b", "smoke", "--sandbox-only"])
    assert _e2b_smoke(args, cloud) == 0
    assert capsys.readouterr().out.split() == ["ok", "exec", "ok", "exit", "code", "ok", "timeout", "ok",
                                              "group", "killed", "ok", "files"]  # fmt: skip
    assert cloud.create_calls[0]["template"] == "base" and cloud.sandboxes[0].killed
