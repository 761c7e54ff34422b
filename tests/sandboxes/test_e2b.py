"""The E2B backend against the SDK fake: what it asks E2B for, and how it maps E2B's answers."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import AsyncSandbox, NotEnoughSpaceException, SandboxException, TemplateException
from e2b.api import handle_api_exception
from e2b.exceptions import format_request_timeout_error, format_sandbox_unavailable_exception
from e2b.retry import resolve_idempotency_key
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.filesystem.filesystem import Filesystem

from harness_trainer.launch.e2b_smoke import main as smoke_main
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.create_retry import MAX_DELAY_S
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.e2b_errors import (
    RETRIED,
    Kind,
    classify,
    retry_delay_s,
    tries_allowed,
)
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_e2b import FakeE2BCloud, FakeLatency, api_error

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon


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
        rate_limit_backoff_s=0.02,
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


async def test_create_gives_up_after_three_tries_naming_the_last_errors_kind_and_text(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.fail_creates = 5
    task = make_task()
    with pytest.raises(SandboxStartError) as failed:
        await backend.start(task, lifetime_s=60)
    assert str(failed.value) == (
        f"E2B sandbox for {task.name} (template 'tpl-default') did not start after 3 tries; last error: "
        "unavailable (ServiceBusyException): 503: Service temporarily unavailable, please retry. - "
        "fake: the E2B API is unavailable"
    )
    assert len(cloud.create_calls) == 3 and not cloud.sandboxes


async def test_bad_credentials_are_not_retried(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.fail_creates, cloud.failure = 5, api_error(401, "invalid API key")
    with pytest.raises(
        SandboxStartError, match=r"E2B refused to create a sandbox .* after 1 try; last error: auth"
    ):
        await backend.start(make_task(), lifetime_s=60)
    assert len(cloud.create_calls) == 1


# Each failure as the SDK raises it from ``AsyncSandbox.create`` (see e2b_errors), and its kind.
_REQUEST = httpx.Request("POST", "https://api.e2b.app/v2/sandboxes")
RETRIED_FAILURES = {
    "connection refused": (  # as the SDK's pyqwest transport maps a refused connect
        lambda: httpx.ConnectError("tcp connect error: Connection refused (os error 111)", request=_REQUEST),
        Kind.TRANSPORT,
    ),
    "read timeout": (lambda: httpx.ReadTimeout("timed out", request=_REQUEST), Kind.TRANSPORT),
    "429": (lambda: api_error(429, "too many sandbox creations"), Kind.RATE_LIMITED),
    "503": (lambda: api_error(503, "no capacity to place a sandbox"), Kind.UNAVAILABLE),
    "500": (lambda: api_error(500, "failed to create sandbox"), Kind.UNAVAILABLE),
    "502": (lambda: api_error(502, "bad gateway"), Kind.UNAVAILABLE),
    "request timeout": (format_request_timeout_error, Kind.UNAVAILABLE),
    "envd unreachable": (
        lambda: format_sandbox_unavailable_exception("port is not open"),
        Kind.UNAVAILABLE,
    ),
    "guest unresponsive": (
        lambda: handle_api_exception(
            httpx.Response(409, json={"code": 409, "message": "envd did not answer", "error_code": GUEST})
        ),
        Kind.UNAVAILABLE,
    ),
    "build not ready": (lambda: api_error(404, "template 'tpl' has no ready build"), Kind.TEMPLATE_NOT_READY),
}
REFUSED_FAILURES = {
    "401": (lambda: api_error(401, "invalid API key"), Kind.AUTHENTICATION),
    "bad idempotency key": (lambda: _raised(resolve_idempotency_key, "Not A Key!"), Kind.INVALID_ARGUMENT),
    "400": (lambda: api_error(400, "Timeout cannot be greater than 24 hours"), Kind.INVALID_ARGUMENT),
    "unknown template": (lambda: api_error(404, "template 'tpl' not found"), Kind.TEMPLATE_NOT_FOUND),
    "old envd": (
        lambda: TemplateException("You need to update the template to use the new SDK."),
        Kind.TEMPLATE_UNUSABLE,
    ),
    "no space": (lambda: NotEnoughSpaceException("not enough disk space"), Kind.NOT_ENOUGH_SPACE),
    "403": (lambda: api_error(403, "you don't have access to template 'tpl'"), Kind.REFUSED),
}
UNKNOWN_FAILURES = {
    "no body": (lambda: Exception("Body of the request is None"), Kind.UNKNOWN),
    "no status": (lambda: SandboxException("internal error: Request failed"), Kind.UNKNOWN),
}
GUEST = "sandbox_snapshot_guest_agent_unresponsive"


def _raised(function: Any, *args: Any) -> Exception:
    try:
        function(*args)
    except Exception as exc:
        return exc
    raise AssertionError(f"{function.__name__} did not raise")


@pytest.mark.parametrize(
    ("make", "kind"),
    [*RETRIED_FAILURES.values(), *REFUSED_FAILURES.values(), *UNKNOWN_FAILURES.values()],
    ids=[*RETRIED_FAILURES, *REFUSED_FAILURES, *UNKNOWN_FAILURES],
)
def test_each_sdk_failure_has_its_kind(make: Any, kind: Kind) -> None:
    assert classify(make()) is kind


@pytest.mark.parametrize(("make", "kind"), RETRIED_FAILURES.values(), ids=RETRIED_FAILURES)
async def test_a_transient_failure_is_tried_create_attempts_times(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, make: Any, kind: Kind
) -> None:
    cloud.create_failures = [make() for _ in range(5)]
    with pytest.raises(SandboxStartError, match=f"did not start after 3 tries; last error: {kind} "):
        await backend.start(make_task(), lifetime_s=60)
    assert len(cloud.create_calls) == 3 and not cloud.sandboxes


@pytest.mark.parametrize(("make", "kind"), REFUSED_FAILURES.values(), ids=REFUSED_FAILURES)
async def test_a_permanent_failure_is_not_retried(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, make: Any, kind: Kind
) -> None:
    cloud.create_failures = [make() for _ in range(5)]
    task = make_task()
    with pytest.raises(SandboxStartError) as failed:
        await backend.start(task, lifetime_s=60)
    message = str(failed.value)
    assert message.startswith(
        f"E2B refused to create a sandbox for {task.name} (template 'tpl-default') after 1 try; "
        f"last error: {kind} ("
    )
    assert str(cloud.create_failures[0]) in message
    assert len(cloud.create_calls) == 1


@pytest.mark.parametrize(("make", "kind"), UNKNOWN_FAILURES.values(), ids=UNKNOWN_FAILURES)
async def test_an_unknown_failure_gets_one_more_try(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, make: Any, kind: Kind
) -> None:
    cloud.create_failures = [make() for _ in range(5)]
    with pytest.raises(SandboxStartError, match="did not start after 2 tries; last error: unknown "):
        await backend.start(make_task(), lifetime_s=60)
    assert len(cloud.create_calls) == 2


async def test_transient_failures_then_a_success_start_the_sandbox(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.create_failures = [RETRIED_FAILURES["connection refused"][0](), RETRIED_FAILURES["429"][0]()]
    sandbox = await backend.start(make_task(), lifetime_s=60)
    await sandbox.close()
    assert len(cloud.create_calls) == 3 and len(cloud.sandboxes) == 1


async def test_a_permanent_failure_after_a_transient_one_stops_the_tries(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.create_failures = [api_error(503, "busy"), api_error(404, "template 'tpl-default' not found")]
    with pytest.raises(SandboxStartError, match=r"refused .* after 2 tries; last error: template not found"):
        await backend.start(make_task(), lifetime_s=60)
    assert len(cloud.create_calls) == 2


async def test_the_waits_between_tries_back_off_from_the_defaults_longer_after_a_429(
    cloud: FakeE2BCloud, make_task: TaskFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default backoffs (2 s, 10 s after a 429), doubled per try, jittered into [half, full]: the sleeps
    are recorded, not slept."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def record(delay: float, *args: Any, **kwargs: Any) -> Any:
        slept.append(delay)
        return await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", record)
    backend = E2BSandboxBackend(template="t", sandbox_class=cloud, create_attempts=5)
    cloud.create_failures = [api_error(429, "slow down"), api_error(503, "busy")] * 3
    with pytest.raises(SandboxStartError, match="after 5 tries; last error: rate limited"):
        await backend.start(make_task(), lifetime_s=60)
    full = [10.0, 2.0 * 2, 10.0 * 4, 2.0 * 8]  # 429, 503, 429, 503
    assert len(slept) == 4
    assert all(limit / 2 <= delay <= limit for delay, limit in zip(slept, full, strict=True)), slept


def test_the_backoff_is_capped_and_jittered_within_half_to_full() -> None:
    delay = partial(retry_delay_s, base_s=2.0, rate_limit_base_s=10.0)
    assert delay(Kind.TRANSPORT, 1, draw=lambda: 0.0) == 1.0
    assert delay(Kind.TRANSPORT, 3, draw=lambda: 1.0) == 8.0
    assert delay(Kind.RATE_LIMITED, 2, draw=lambda: 0.0) == 10.0
    assert delay(Kind.UNAVAILABLE, 30, draw=lambda: 1.0) == MAX_DELAY_S
    assert delay(Kind.RATE_LIMITED, 30, draw=lambda: 0.0) == MAX_DELAY_S / 2


def test_transient_kinds_get_every_try_unknown_ones_two_and_the_rest_one() -> None:
    tries = {kind: tries_allowed(kind, 3) for kind in Kind}
    assert {kind for kind, n in tries.items() if n == 3} == set(RETRIED)
    assert tries[Kind.UNKNOWN] == 2 and tries_allowed(Kind.UNKNOWN, 1) == 1
    assert {n for kind, n in tries.items() if kind not in RETRIED and kind is not Kind.UNKNOWN} == {1}


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
    backend.api_key, backend.run_id = "e2b_test", "run-sig"  # the run: its snapshots are listed too
    task = make_task()
    sandbox = await backend.start(task, lifetime_s=60, env={"A": "1"})
    try:
        await sandbox.exec("sleep 5", timeout_s=0.3)
        await sandbox.write_file("/app/x.sh", "echo", mode=0o755)
        await sandbox.read_file("/app/x.sh")
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "f.txt").write_text("f")
        await sandbox.upload_dir(tmp_path / "up", "/tests")
        snapshot = await backend.snapshot(sandbox)
        await (await backend.start_from(snapshot, task, lifetime_s=60, env={"A": "1"})).close()
        await backend.drop(snapshot)
    finally:
        await sandbox.close()
    real = {
        "commands.run": inspect.signature(Commands.run),
        "files.read": inspect.signature(Filesystem.read),
        "files.write": inspect.signature(Filesystem.write),
        "files.write_files": inspect.signature(Filesystem.write_files),
        "create_snapshot": inspect.signature(AsyncSandbox.create_snapshot),
        "kill": inspect.signature(AsyncSandbox.kill),
    }
    assert [call["template"] for call in cloud.create_calls] == ["tpl-default", snapshot.id]
    for call in cloud.create_calls:
        inspect.signature(AsyncSandbox.create).bind(**call)
    names = [name for name, _ in cloud.sandboxes[0].calls]
    assert set(names) == set(real)
    for name, kwargs in cloud.sandboxes[0].calls:
        real[name].bind(None, **kwargs)
    assert cloud.snapshots.list_calls and cloud.snapshots.delete_calls  # the run's reaping; the drop
    for call in cloud.snapshots.list_calls:  # AsyncSandbox.list_snapshots() on the class
        inspect.signature(AsyncSandbox._cls_list_snapshots).bind(**call)
    for call in cloud.snapshots.delete_calls:
        inspect.signature(AsyncSandbox.delete_snapshot).bind(**call)


def test_the_smoke_test_needs_an_api_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    assert smoke_main(["--smoke"]) == 2
    assert "E2B_API_KEY" in capsys.readouterr().err


async def test_a_start_cancelled_while_e2b_creates_its_sandbox_kills_what_the_create_made(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    """The run stops while a create is in flight: E2B makes the sandbox anyway (the request was sent), and
    nobody would kill it; the backend waits for the create and kills what it made."""
    cloud.latency = FakeLatency(create_s=(0.5, 0.5))
    start = asyncio.ensure_future(backend.start(make_task(), lifetime_s=60))
    await asyncio.sleep(0.1)  # the create is in flight
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await backend.aclose()  # waits for the create it let run on, and its kill
    (made,) = cloud.sandboxes
    assert made.killed and not backend.live
