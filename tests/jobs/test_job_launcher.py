"""The job launcher as a real process supervising fake vLLM / serve / warm-up / trainer processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.jobs.conftest import SECRETS, Launch, alive, wait_until

Launcher = Callable[..., Launch]


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def cmdline_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")


def assert_all_gone(running: Launch) -> None:
    pids = running.pids()
    assert pids, "no fake process ever started"
    assert wait_until(lambda: not any(alive(pid) for pid in pids.values()), 10), {
        name: pid for name, pid in pids.items() if alive(pid)
    }


def order(running: Launch) -> list[str]:
    return [f"{e['name']}:{e['event']}" for e in sorted(running.events(), key=lambda e: e["t"])]


@pytest.mark.slow
def test_each_step_starts_only_after_the_one_before_is_healthy(launch: Launcher) -> None:
    running = launch(vllm=["--listen-after", "1.5"], serve=["--listen-after", "0.5"])
    assert running.finish() == 0, running.stderr()
    steps = [step for step in order(running) if step.split(":")[1] in ("start", "listening")]
    assert steps == [
        "vllm:start",
        "vllm:listening",
        "serve:start",
        "serve:listening",
        "trainer:start",
    ]
    assert_all_gone(running)


@pytest.mark.parametrize("code", [0, 3])
def test_the_launcher_exits_with_the_trainers_exit_code(launch: Launcher, code: int) -> None:
    running = launch(trainer=["--exit", str(code)])
    assert running.finish() == code, running.stderr()
    assert "trainer exited with code" in running.stderr()
    assert_all_gone(running)


def test_the_trainer_gets_the_server_and_vllm_urls_after_its_own_arguments(launch: Launcher) -> None:
    running = launch(trainer_args=["--harness", "toy", "--max-concurrent-rollouts", "3"])
    assert running.finish() == 0, running.stderr()
    argv = running.wait_for("trainer", "start")["argv"]
    vllm, serve = running.ports["vllm"], running.ports["serve"]
    assert argv[1:] == [
        "--model",
        "fake/model",
        "--sandbox",
        "local",
        "--harness",
        "toy",
        "--max-concurrent-rollouts",
        "3",
        "--server",
        f"http://127.0.0.1:{serve}",
        "--vllm-url",
        f"http://127.0.0.1:{vllm}",
    ]
    serve_argv = running.wait_for("serve", "start")["argv"]
    assert ["--upstream", f"http://127.0.0.1:{vllm}"] == serve_argv[serve_argv.index("--upstream") :][:2]


def test_a_service_that_dies_before_it_is_healthy_stops_the_run_with_an_error_naming_it(
    launch: Launcher,
) -> None:
    running = launch(vllm=["--never-listen", "--die-after", "0.5", "--exit", "7"])
    assert running.finish() == 1
    assert "error: vllm exited with code 7" in running.stderr()
    assert running.event("serve", "start") is None and running.event("trainer", "start") is None
    assert_all_gone(running)


def test_a_service_that_never_answers_health_times_out_naming_it_and_its_url(launch: Launcher) -> None:
    running = launch(vllm=["--never-listen", "--hang"], options=["--vllm-ready-timeout", "1"])
    assert running.finish() == 1
    url = f"http://127.0.0.1:{running.ports['vllm']}/health"
    assert f"error: vllm did not answer {url} within 1s" in running.stderr()
    assert running.event("serve", "start") is None
    assert_all_gone(running)


@pytest.mark.slow
def test_a_service_dying_during_training_stops_the_trainer_and_everything_else(launch: Launcher) -> None:
    running = launch(serve=["--die-after", "2", "--exit", "9"], trainer=["--hang"])
    assert running.finish() == 1
    assert "error: serve exited with code 9" in running.stderr()
    assert running.event("trainer", "start") is not None
    assert_all_gone(running)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_child_and_what_they_spawned(launch: Launcher) -> None:
    running = launch(vllm=["--grandchild"], serve=["--grandchild"], trainer=["--hang", "--grandchild"])
    running.wait_for("trainer", "grandchild")
    assert all(alive(pid) for pid in running.pids().values())
    running.process.send_signal(signal.SIGTERM)
    assert running.finish() == 128 + signal.SIGTERM
    stopped = [
        e["name"] for e in sorted(running.events(), key=lambda e: e["t"]) if e["event"] == "terminated"
    ]
    assert stopped == ["trainer", "serve", "vllm"]  # the trainer first: it checkpoints through the server
    assert set(running.pids()) == {
        "vllm",
        "vllm/grandchild",
        "serve",
        "serve/grandchild",
        "trainer",
        "trainer/grandchild",
    }
    assert_all_gone(running)


def test_a_trainer_that_ignores_sigterm_is_killed_after_its_stop_timeout(launch: Launcher) -> None:
    running = launch(trainer=["--hang", "--ignore-term"], options=["--trainer-stop-timeout", "1"])
    running.wait_for("trainer", "start")
    running.process.send_signal(signal.SIGINT)
    assert running.finish(timeout=30) == 128 + signal.SIGINT
    assert "trainer did not stop within 1s: SIGKILL" in running.stderr()
    assert_all_gone(running)


def test_children_get_sigterm_when_the_launcher_is_killed_outright(launch: Launcher) -> None:
    running = launch(trainer=["--hang"])
    running.wait_for("trainer", "start")
    running.process.kill()
    running.finish()
    assert_all_gone(running)


def test_secrets_reach_only_the_processes_that_need_them_and_no_command_line(launch: Launcher) -> None:
    running = launch(trainer=["--hang"])
    running.wait_for("trainer", "start")
    pids = running.pids()
    expected = {
        "vllm": {"HF_TOKEN"},
        "serve": {"HF_TOKEN", "E2B_API_KEY"},
        "trainer": {"HF_TOKEN", "WANDB_API_KEY"},
    }
    for name, wanted in expected.items():
        env = environ_of(pids[name])
        assert {key for key in SECRETS if key in env} == wanted, name
        assert all(env[key] == SECRETS[key] for key in wanted)
        assert not any(value in cmdline_of(pids[name]) for value in SECRETS.values()), name
    assert environ_of(pids["vllm"])["VLLM_SERVER_DEV_MODE"] == "1"
    assert environ_of(pids["serve"])["MAX_CONCURRENT_ENVS"] == "9"  # the trainer's default 8, plus one
    assert environ_of(pids["trainer"])["CUDA_VISIBLE_DEVICES"] == "1"
    running.process.send_signal(signal.SIGTERM)
    running.finish()
    assert not any(value in running.stderr() for value in SECRETS.values())


def test_with_e2b_the_warm_up_runs_between_the_server_and_the_trainer(launch: Launcher) -> None:
    url = "https://job--8300.hf.jobs"
    running = launch(trainer_args=["--sandbox", "e2b"], options=["--public-url", url])
    assert running.finish() == 0, running.stderr()
    steps = [step for step in order(running) if not step.endswith(("listening", "terminated"))]
    assert steps == ["vllm:start", "serve:start", "warm:start", "warm:exit", "trainer:start", "trainer:exit"]
    warm = running.wait_for("warm", "start")
    assert warm["argv"][1:] == [
        *("--public-url", url, "--sandbox", "e2b", "--template", "base", "--image", "python:3.12")
    ]
    serve_argv = running.wait_for("serve", "start")["argv"]
    assert serve_argv[-2:] == ["--public-url", url]
    assert serve_argv[serve_argv.index("--capture-host") + 1] == "0.0.0.0"


def test_a_failed_warm_up_stops_the_run_before_the_trainer_starts(launch: Launcher) -> None:
    running = launch(
        warm=["--exit", "1"], trainer_args=["--sandbox", "e2b"], options=["--public-url", "http://x"]
    )
    assert running.finish() == 1
    assert "error: the warm-up sandbox exited with code 1" in running.stderr()
    assert running.event("trainer", "start") is None
    assert_all_gone(running)


@pytest.mark.parametrize(("sandbox", "credential"), [("e2b", "E2B_API_KEY"), ("hf", "HF_TOKEN")])
def test_the_warm_up_gets_its_own_backends_credential_and_no_other_secret(
    launch: Launcher, sandbox: str, credential: str
) -> None:
    running = launch(
        warm=["--hang"],
        trainer_args=["--sandbox", sandbox],
        options=["--public-url", "http://x", "--warm-timeout", "30"],
    )
    warm = running.wait_for("warm", "start")
    assert warm["argv"][warm["argv"].index("--sandbox") + 1] == sandbox
    env = environ_of(warm["pid"])
    assert {name: env[name] for name in SECRETS if name in env} == {credential: SECRETS[credential]}
    os.kill(running.process.pid, signal.SIGTERM)
    assert running.finish() == 128 + signal.SIGTERM
    assert_all_gone(running)
