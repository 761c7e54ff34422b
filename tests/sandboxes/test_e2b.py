"""The E2B backend against the SDK fake: what it asks E2B for, and how it maps E2B's answers."""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("e2b")

from e2b import AsyncSandbox, AuthenticationException
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.filesystem.filesystem import Filesystem

from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.e2b_smoke import main as smoke_main
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_e2b import FakeE2BCloud


@pytest.fixture
def cloud(tmp_path: Path) -> FakeE2BCloud:
    return FakeE2BCloud(tmp_path / "e2b")


@pytest.fixture
async def backend(cloud: FakeE2BCloud) -> AsyncIterator[E2BSandboxBackend]:
    started = E2BSandboxBackend(
        template_map={"python:3.11-slim": "tpl-python"},
        template="tpl-default",
        sandbox_class=cloud,
        retry_backoff_s=0.01,
        kill_grace_s=0.3,
        lifetime_margin_s=100,
    )
    yield started
    leaked = started.live
    await started.aclose()
    assert not leaked


async def test_create_asks_for_the_tasks_template_and_a_lifetime_above_the_timeouts(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    task = make_task(docker_image="python:3.11-slim", agent_timeout_sec=600, verifier_timeout_sec=120)
    sandbox = await backend.start(task, lifetime_s=300, env={"SESSION": "abc"})
    await sandbox.close()
    (call,) = cloud.create_calls
    assert call["template"] == "tpl-python"
    assert call["timeout"] == math.ceil(600 + 120 + 100)
    assert call["envs"] == {"SESSION": "abc"}
    assert call["metadata"] == {"harness_trainer_task": task.name, "harness_trainer_owner": backend.owner}
    assert "network" not in call


def test_template_resolution_order(make_task: TaskFactory) -> None:
    backend = E2BSandboxBackend(template="fallback", template_map={"named": "by-name", "img:1": "by-image"})
    assert backend.named_template(make_task(name="named", docker_image="img:1")) == "by-name"
    assert backend.named_template(make_task(docker_image="img:1", extra={"e2b_template": "own"})) == "own"
    assert backend.named_template(make_task(docker_image="img:1")) == "by-image"
    assert backend.named_template(make_task(docker_image="other")) == "fallback"
    assert E2BSandboxBackend().named_template(make_task(docker_image="other")) is None  # built from it


async def test_a_task_without_any_environment_needs_a_named_template(make_task: TaskFactory) -> None:
    with pytest.raises(SandboxStartError, match=r"no environment/Dockerfile and no .* docker_image"):
        await E2BSandboxBackend().template_for(make_task())


async def test_envs_are_passed_on_every_command_as_the_configured_user(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60, env={"SESSION": "abc"})
    try:
        await sandbox.exec("true", env={"STEP": "1"})
        await sandbox.exec("true", cwd="/logs", timeout_s=5)
    finally:
        await sandbox.close()
    runs = [kwargs for name, kwargs in cloud.sandboxes[0].calls if name == "commands.run"]
    assert all(run["envs"]["SESSION"] == "abc" and run["user"] == "root" for run in runs)
    assert runs[-2]["envs"] == {"SESSION": "abc", "STEP": "1"} and runs[-2]["timeout"] == 0
    assert runs[-1]["cwd"] == "/logs" and runs[-1]["timeout"] == 5


async def test_the_workdir_comes_from_the_dockerfile(
    backend: E2BSandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task('FROM python:3.11-slim\nUSER root\nWORKDIR /app\nWORKDIR project\nCMD ["bash"]\n')
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        assert sandbox.workdir == "/app/project"
        assert (await sandbox.exec("pwd")).stdout == "/app/project\n"
    finally:
        await sandbox.close()


async def test_create_is_retried_with_backoff_then_succeeds(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.fail_creates = 2
    sandbox = await backend.start(make_task(), lifetime_s=60)
    await sandbox.close()
    assert len(cloud.create_calls) == 3


async def test_create_gives_up_after_three_tries(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.fail_creates = 5
    with pytest.raises(
        SandboxStartError, match="did not start after 3 tries: fake: the E2B API is unavailable"
    ):
        await backend.start(make_task(), lifetime_s=60)
    assert len(cloud.create_calls) == 3 and not cloud.sandboxes


async def test_bad_credentials_are_not_retried(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.fail_creates, cloud.failure = 5, AuthenticationException("invalid API key")
    with pytest.raises(SandboxStartError, match="invalid API key"):
        await backend.start(make_task(), lifetime_s=60)
    assert len(cloud.create_calls) == 1


async def test_close_kills_the_sandbox_once(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    await sandbox.close()
    await sandbox.close()
    assert [name for name, _ in cloud.sandboxes[0].calls].count("kill") == 1
    assert cloud.sandboxes[0].killed


async def test_a_timeout_sends_a_group_kill(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        result = await sandbox.exec("sleep 30", timeout_s=0.5)
    finally:
        await sandbox.close()
    assert result.timed_out
    commands = [kwargs["cmd"] for name, kwargs in cloud.sandboxes[0].calls if name == "commands.run"]
    assert 'kill -TERM -- "-$p"' in commands[-1]


async def test_no_internet_denies_egress_except_the_allowed_hosts(
    cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    backend = E2BSandboxBackend(template="t", sandbox_class=cloud, allow_out=["proxy.example.com"])
    sandbox = await backend.start(make_task(allow_internet=False), lifetime_s=60)
    await sandbox.close()
    assert cloud.create_calls[0]["network"] == {"deny_out": ["0.0.0.0/0"], "allow_out": ["proxy.example.com"]}


async def test_every_sdk_call_binds_to_the_real_sdk_signatures(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path
) -> None:
    backend.api_key = "e2b_test"
    sandbox = await backend.start(make_task(), lifetime_s=60, env={"A": "1"})
    try:
        await sandbox.exec("sleep 5", timeout_s=0.3)
        await sandbox.write_file("/app/x.sh", "echo", mode=0o755)
        await sandbox.read_file("/app/x.sh")
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "f.txt").write_text("f")
        await sandbox.upload_dir(tmp_path / "up", "/tests")
    finally:
        await sandbox.close()
    real = {
        "commands.run": inspect.signature(Commands.run),
        "files.read": inspect.signature(Filesystem.read),
        "files.write": inspect.signature(Filesystem.write),
        "files.write_files": inspect.signature(Filesystem.write_files),
        "kill": inspect.signature(AsyncSandbox.kill),
    }
    for call in cloud.create_calls:
        inspect.signature(AsyncSandbox.create).bind(**call)
    names = [name for name, _ in cloud.sandboxes[0].calls]
    assert set(names) == set(real)
    for name, kwargs in cloud.sandboxes[0].calls:
        real[name].bind(None, **kwargs)


def test_the_smoke_test_needs_an_api_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    assert smoke_main(["--smoke"]) == 2
    assert "E2B_API_KEY" in capsys.readouterr().err
