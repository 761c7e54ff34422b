"""Fixtures for the sandbox tests: task folders built in ``tmp_path``, and a check that no test leaves a
sandbox process behind."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.sandboxes.docker import DockerSandboxBackend
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

# Every local sandbox (and every fake E2B sandbox) is launched by a process with this in its command line;
# the sandbox's init dies with it (unshare --kill-child).
LAUNCHER_MARKER = "ht-init"

TaskFactory = Callable[..., HarborTask]


def live_processes(needle: str, *, parent: int | None = None) -> list[int]:
    """Pids (not zombies, not this process) whose command line contains ``needle`` (and whose parent is
    ``parent``, when given)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if needle in cmdline and fields[0] != "Z" and parent in (None, int(fields[1])):
            found.append(int(entry.name))
    return found


def wait_until_gone(needle: str, timeout_s: float = 5.0, *, parent: int | None = None) -> list[int]:
    """Polls until no live process matches; returns the pids still there at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := live_processes(needle, parent=parent)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def wait_until_present(needle: str, count: int = 1, timeout_s: float = 5.0) -> list[int]:
    """Polls until ``count`` live processes match (a background child may not have exec'd yet)."""
    deadline = time.monotonic() + timeout_s
    while len(found := live_processes(needle)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


# Mount points the sandboxes create on the host; whatever a sandbox writes must land in its own root.
HOST_MOUNT_POINTS = ("/app", "/logs", "/tests", "/solution", "/home/user")


def _host_contents() -> dict[str, list[str]]:
    return {p: sorted(os.listdir(p)) for p in HOST_MOUNT_POINTS if os.path.isdir(p)}


@pytest.fixture(autouse=True)
def no_leftover_sandbox_processes() -> Iterator[None]:
    """After each test: no sandbox this process launched still running (other processes on the machine
    may run their own), and nothing written to the host's mount points."""
    contents = _host_contents()
    yield
    leftovers = wait_until_gone(LAUNCHER_MARKER, timeout_s=3.0, parent=os.getpid())
    assert not leftovers, f"sandboxes left running: launcher pids {leftovers}"
    after = _host_contents()
    changed = {p: names for p, names in after.items() if names != contents.get(p, [])}
    assert not changed, f"a sandbox wrote to the host's own directories: {changed}"


@pytest.fixture
def make_task(tmp_path: Path) -> TaskFactory:
    """Builds a minimal Harbor task folder (task.toml, instruction.md, tests/test.sh, optional
    environment/Dockerfile and build-context files) and returns it as a HarborTask."""
    counter = iter(range(1_000_000))

    def build(
        dockerfile: str | None = None,
        *,
        files: dict[str, str | bytes] | None = None,
        name: str | None = None,
        agent_timeout_sec: float = 60.0,
        verifier_timeout_sec: float = 30.0,
        **environment: object,
    ) -> HarborTask:
        name = name or f"task-{next(counter)}"
        folder = tmp_path / "tasks" / name
        (folder / "tests").mkdir(parents=True)
        (folder / "environment").mkdir()
        (folder / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 60\n')
        (folder / "instruction.md").write_text("Write 1 to /logs/verifier/reward.txt\n")
        (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
        if dockerfile is not None:
            (folder / "environment" / "Dockerfile").write_text(dockerfile)
        for relative, content in (files or {}).items():
            target = folder / "environment" / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        return HarborTask(
            name=name,
            path=folder,
            instruction="Write 1 to /logs/verifier/reward.txt",
            config={},
            agent_timeout_sec=agent_timeout_sec,
            verifier_timeout_sec=verifier_timeout_sec,
            environment=EnvironmentSpec(**environment),  # type: ignore[arg-type]
        )

    return build


@pytest.fixture
async def docker_backend() -> AsyncIterator[DockerSandboxBackend]:
    """A docker backend on the real daemon; the test must close what it started."""
    started = DockerSandboxBackend(kill_grace_s=0.5)
    yield started
    leaked = started.live
    await started.aclose()
    assert not leaked, f"the test left sandboxes open: {[s.id for s in leaked]}"


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fake Hugging Face Hub (Jobs API and sandbox servers, :mod:`tests.sandboxes.fake_hf`) that
    ``huggingface_hub`` talks to for the test; it must have been asked for nothing it does not know."""
    from tests.sandboxes.fake_hf import FakeHub

    with FakeHub(tmp_path / "hf") as hub, hub.use(monkeypatch):
        yield hub
    assert not hub.unknown, f"the library called routes the fake lacks: {hub.unknown}"
