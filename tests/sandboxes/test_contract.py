"""The sandbox contract, run against every backend: local and Docker for real, E2B against the SDK fake, HF
against a fake Hub over HTTP.

Each test is one promise of :mod:`harness_trainer.sandboxes.base`. Processes are looked up in the host's
``/proc`` by a command line unique to the test, so a test sees only what it started.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.sandboxes.base import SandboxBackend, SandboxError
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.local import LocalSandboxBackend
from tests.sandboxes.conftest import TaskFactory, live_processes, wait_until_gone, wait_until_present


def local_backend(tmp_path: Path) -> SandboxBackend:
    return LocalSandboxBackend(tmp_path / "sandboxes", kill_grace_s=0.5)


def e2b_backend(tmp_path: Path) -> SandboxBackend:
    """E2B against the SDK fake (the cloud cannot be reached from here)."""
    from tests.sandboxes.fake_e2b import FakeE2BCloud

    cloud = FakeE2BCloud(tmp_path / "e2b")
    return E2BSandboxBackend(template="fake", sandbox_class=cloud, kill_grace_s=0.5, retry_backoff_s=0)


def docker_backend(tmp_path: Path) -> SandboxBackend:
    """Docker against the real daemon (the ``docker`` mark skips it without one, or fails it in CI)."""
    from harness_trainer.sandboxes.docker import DockerSandboxBackend

    return DockerSandboxBackend(kill_grace_s=0.5)


def hf_backend(tmp_path: Path) -> SandboxBackend:
    """HF dedicated sandboxes against the fake Hub (``fake_hub``: the Jobs API and sandbox servers over
    HTTP). Pooled sandboxes write only their home, so the task paths of this contract need dedicated ones
    (test_hf covers the pool)."""
    from harness_trainer.sandboxes.hf import HfSandboxBackend

    return HfSandboxBackend(dedicated=True, image="debian:bookworm-slim", kill_grace_s=0.5, retry_backoff_s=0)


CONTRACT_BACKENDS: dict[str, Callable[[Path], SandboxBackend]] = {
    "local": local_backend,
    "e2b": e2b_backend,
    "docker": docker_backend,
    "hf": hf_backend,
}
"""One fixture per registered backend (``SANDBOXES``; test_capabilities checks none is missing)."""
NEEDS = {  # the marks of backends that need something of the machine (the fake E2B exports Docker images)
    "docker": pytest.mark.docker,
    "e2b": pytest.mark.docker,
    "hf": pytest.mark.docker,
}


@pytest.fixture(params=[pytest.param(name, marks=NEEDS.get(name, ())) for name in sorted(CONTRACT_BACKENDS)])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    if request.param == "hf":
        request.getfixturevalue("fake_hub")  # the Hub it talks to, up for the test and after it
    started: Any = CONTRACT_BACKENDS[request.param](tmp_path)
    yield started
    leaked = started.live
    await started.aclose()
    assert not leaked, f"the test left sandboxes open: {[s.id for s in leaked]}"


def marker() -> str:
    """A sleep duration no other process on the machine uses, to find this test's processes."""
    return f"{random.randint(100_000, 999_999)}"


async def test_exec_reports_exit_code_stdout_and_stderr(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        result = await sandbox.exec("echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (
            3,
            "out\n",
            "err\n",
            False,
        )
        assert (await sandbox.exec("true")).exit_code == 0
    finally:
        await sandbox.close()


async def test_commands_start_in_the_workdir_and_honour_cwd(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        assert sandbox.workdir == "/app"
        assert (await sandbox.exec("pwd")).stdout == "/app\n"
        assert (await sandbox.exec("pwd", cwd="/logs")).stdout == "/logs\n"
        await sandbox.exec("mkdir -p sub")
        assert (await sandbox.exec("pwd", cwd="sub")).stdout == "/app/sub\n"
    finally:
        await sandbox.close()


async def test_the_tasks_own_workdir_beats_the_dockerfiles(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    """``[environment] workdir`` (Harbor's field) is where the agent starts, whatever the image says."""
    task = make_task("FROM debian:bookworm-slim\nWORKDIR /srv/from-image\n", workdir="/srv/from-task")
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        assert sandbox.workdir == "/srv/from-task"
        assert (await sandbox.exec("pwd")).stdout == "/srv/from-task\n"
    finally:
        await sandbox.close()


async def test_env_from_start_and_from_the_command_are_layered(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60, env={"A": "start", "B": "start"})
    try:
        result = await sandbox.exec('echo "$A $B $C"', env={"B": "command", "C": "3"})
        assert result.stdout == "start command 3\n"
        assert (await sandbox.exec('echo "$HOME"')).stdout == f"{sandbox.home}\n"
    finally:
        await sandbox.close()


async def test_timeout_kills_the_whole_process_group(backend: SandboxBackend, make_task: TaskFactory) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    try:
        result = await sandbox.exec(f"echo started; sleep {tag} & sleep {tag}1", timeout_s=1.0)
        assert result.timed_out and result.exit_code is None
        assert "started" in result.stdout
        assert not wait_until_gone(f"sleep {tag}"), "a child of the timed-out command survived"
        assert (await sandbox.exec("echo still usable")).stdout == "still usable\n"
    finally:
        await sandbox.close()


async def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    try:
        began = time.monotonic()
        result = await sandbox.exec(f"trap '' TERM; sleep {tag}", timeout_s=0.5)
        assert result.timed_out and time.monotonic() - began < 4
        assert not wait_until_gone(f"sleep {tag}")
    finally:
        await sandbox.close()


async def test_a_cancelled_exec_leaves_nothing_running(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    try:
        running = asyncio.ensure_future(sandbox.exec(f"sleep {tag} & sleep {tag}1"))
        for _ in range(100):
            if live_processes(f"sleep {tag}"):
                break
            await asyncio.sleep(0.05)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        for _ in range(100):
            if not live_processes(f"sleep {tag}"):
                break
            await asyncio.sleep(0.05)
        assert not live_processes(f"sleep {tag}")
    finally:
        await sandbox.close()


async def test_a_background_child_does_not_hold_exec_open(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        result = await asyncio.wait_for(sandbox.exec(f"sleep {marker()} & echo back"), timeout=5)
        assert result.exit_code == 0 and result.stdout == "back\n"
    finally:
        await sandbox.close()


async def test_files_round_trip_with_mode(backend: SandboxBackend, make_task: TaskFactory) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        blob = bytes(range(256))
        await sandbox.write_file("/app/data/blob.bin", blob)
        assert await sandbox.read_file("/app/data/blob.bin") == blob
        await sandbox.write_file("run.sh", "#!/bin/bash\necho ran\n", mode=0o755)
        assert (await sandbox.exec("./run.sh")).stdout == "ran\n"
        await sandbox.exec("printf made > /app/made.txt")
        assert await sandbox.read_file("made.txt") == b"made"
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("/app/missing.txt")
    finally:
        await sandbox.close()


async def test_upload_dir_copies_a_tree(
    backend: SandboxBackend, make_task: TaskFactory, tmp_path: Path
) -> None:
    task = make_task()
    (task.tests_dir / "data").mkdir()
    (task.tests_dir / "data" / "expected.txt").write_text("42\n")
    (task.tests_dir / "test.sh").chmod(0o755)
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        await sandbox.upload_dir(task.tests_dir, "/tests")
        assert (await sandbox.exec("cat /tests/data/expected.txt")).stdout == "42\n"
        assert (await sandbox.exec("/tests/test.sh && cat /logs/verifier/reward.txt")).stdout == "1\n"
    finally:
        await sandbox.close()


async def test_task_paths_exist_at_their_absolute_paths(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        result = await sandbox.exec(
            "test -d /logs/agent && test -d /logs/verifier && test -d /tests && test -d /app"
        )
        assert result.exit_code == 0, result.stderr
        await sandbox.exec("echo 0.5 > /logs/verifier/reward.txt")
        assert await sandbox.read_file("/logs/verifier/reward.txt") == b"0.5\n"
        await sandbox.write_file("/logs/agent/note.txt", "hello")
        assert (await sandbox.exec("cat /logs/agent/note.txt")).stdout == "hello"
    finally:
        await sandbox.close()


async def test_concurrent_sandboxes_do_not_see_each_others_logs(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task()
    first, second = await asyncio.gather(
        backend.start(task, lifetime_s=60), backend.start(task, lifetime_s=60)
    )
    try:
        await asyncio.gather(
            first.exec("echo 1 > /logs/verifier/reward.txt; touch /app/only-first"),
            second.exec("echo 0 > /logs/verifier/reward.txt"),
        )
        assert await first.read_file("/logs/verifier/reward.txt") == b"1\n"
        assert await second.read_file("/logs/verifier/reward.txt") == b"0\n"
        assert (await second.exec("ls /app")).stdout == ""
    finally:
        await asyncio.gather(first.close(), second.close())


async def test_close_is_idempotent_and_kills_what_runs(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    result = await sandbox.exec(f"nohup sleep {tag} >/dev/null 2>&1 &")
    assert result.exit_code == 0
    assert wait_until_present(f"sleep {tag}"), "the background process should run until close"
    await sandbox.close()
    await sandbox.close()
    assert not wait_until_gone(f"sleep {tag}")
    with pytest.raises(SandboxError):
        await sandbox.exec("true")


async def test_backend_aclose_closes_what_it_started(backend: SandboxBackend, make_task: TaskFactory) -> None:
    task = make_task()
    sandboxes = [await backend.start(task, lifetime_s=60) for _ in range(3)]
    tag = marker()
    await sandboxes[0].exec(f"nohup sleep {tag} >/dev/null 2>&1 &")
    await backend.aclose()
    assert all(getattr(s, "closed", False) for s in sandboxes)
    assert not wait_until_gone(f"sleep {tag}")


async def test_prepare_is_idempotent_concurrent_and_starts_nothing(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task()
    await asyncio.gather(*(backend.prepare(task) for _ in range(4)))
    await backend.prepare(task)
    assert backend.live == []  # type: ignore[attr-defined]
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        assert (await sandbox.exec("true")).exit_code == 0
    finally:
        await sandbox.close()


def left_behind(sandbox: Any) -> list[str]:
    """What of a closed sandbox is still there, where this machine can see it: the local root, the Docker
    container, the fake E2B cloud's files (HF: its kill is one call, checked by ``closed`` and the Hub)."""
    from harness_trainer.sandboxes.docker_sandbox import DockerSandbox
    from harness_trainer.sandboxes.e2b import E2BSandbox
    from harness_trainer.sandboxes.local import LocalSandbox

    if isinstance(sandbox, LocalSandbox):
        return [str(sandbox.root)] if sandbox.root.exists() else []
    if isinstance(sandbox, E2BSandbox):
        folder = sandbox.sdk_sandbox.rootfs.folder
        return [str(folder)] if folder.exists() or not sandbox.sdk_sandbox.killed else []
    if isinstance(sandbox, DockerSandbox):
        import docker

        client = docker.from_env()
        try:
            return [c.id for c in client.containers.list(all=True) if c.id == sandbox.container]
        finally:
            client.close()
    return []


async def test_a_close_cancelled_twice_half_way_still_ends_the_sandbox(
    backend: SandboxBackend, make_task: TaskFactory
) -> None:
    """A rollout cancelled while it closes its sandbox (a stopping run cancels it again) still ends it
    entirely: the close runs to its end, then its caller's cancellation is raised."""
    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    await sandbox.exec(f"nohup sleep {tag} >/dev/null 2>&1 &")
    closing = asyncio.ensure_future(sandbox.close())
    for _ in range(2):
        await asyncio.sleep(0)  # the close has begun, and is cut where it first waits
        closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not wait_until_gone(f"sleep {tag}")
    assert left_behind(sandbox) == []
    assert sandbox not in backend.live
