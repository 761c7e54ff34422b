"""What only the local backend promises of its snapshots (:mod:`harness_trainer.sandboxes.local_snapshots`):
members skip the Dockerfile's steps, see the snapshot through an overlay (or a copy where none can be
mounted) in both modes, leave no mount behind, and a snapshot folder whose owner died is swept."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import harness_trainer.sandboxes.local_snapshots as local_snapshots
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.rootless import probe
from tests.sandboxes.conftest import HOST_MOUNT_POINTS, TaskFactory

SLOW_SETUP = """\
FROM python:3.11-slim
WORKDIR /app
ENV GREETING=hello
RUN echo built >> built.txt
RUN sleep 2
"""


def _mode_or_skip(mode: str) -> str:
    if (why := probe(next(m for m in LocalSandboxBackend.modes if m.name == mode))) is not None:
        pytest.skip(f"no {mode} mode here: {why}")
    return mode


@pytest.fixture(params=["root", "rootless", "rootless-copy"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[LocalSandboxBackend]:
    """A backend in each mode; ``rootless-copy`` is the rootless mode on a kernel without overlayfs in user
    namespaces (members get a full copy)."""
    mode = _mode_or_skip(request.param.split("-")[0])
    if request.param.endswith("-copy"):
        monkeypatch.setattr(local_snapshots, "overlay_works", lambda mode, base_dir: False)
    started = LocalSandboxBackend(tmp_path / "sandboxes", kill_grace_s=0.5, mode=mode)
    yield started
    leaked, held = started.live, started.snapshots
    await started.aclose()
    assert not leaked and not held
    assert os.listdir(started.base_dir) == [], "aclose left something in the base dir"


def _mounts_of(pid: int) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of each mount ``pid`` sees."""
    found = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        found.append((fields[4], fields[separator + 1]))
    return found


def _host_mounts_of(backend: LocalSandboxBackend) -> list[str]:
    """This process's mounts that a sandbox or a snapshot of ``backend`` could have made (the whole table
    also changes with whatever else runs on the machine: Docker's own mounts)."""
    ours = (str(backend.base_dir), *(f" {point} " for point in HOST_MOUNT_POINTS))
    return [
        line for line in Path("/proc/self/mountinfo").read_text().splitlines() if any(o in line for o in ours)
    ]


async def test_a_member_has_what_the_run_steps_made_without_running_them(
    backend: LocalSandboxBackend, make_task: TaskFactory, request: pytest.FixtureRequest
) -> None:
    task = make_task(SLOW_SETUP)
    began = time.monotonic()
    source = await backend.start(task, lifetime_s=60)
    assert time.monotonic() - began >= 2.0
    try:
        snapshot = await backend.snapshot(source)
    finally:
        await source.close()
    began = time.monotonic()
    member = await backend.start_from(snapshot, task, lifetime_s=60, env={"EXTRA": "given"})
    took = time.monotonic() - began
    try:
        assert took < 1.5, f"the member took {took:.1f}s to start: the RUN steps ran again?"
        seen = await member.exec('cat built.txt; echo "$GREETING $EXTRA"; pwd')
        assert (seen.exit_code, seen.stdout) == (0, "built\nhello given\n/app\n"), seen.stderr
        layers = {point: kind for point, kind in _mounts_of(member.pid) if point in member.mounts}
        copy = request.node.callspec.params["backend"].endswith("-copy")
        assert set(layers) == set(member.mounts)
        assert set(layers.values()) != {"overlay"} if copy else set(layers.values()) == {"overlay"}
        await member.write_file("~/.cache/x", "mine")
        mine = await member.exec("cat ~/.cache/x; echo; test -f ~/.bash_profile && echo profile")
        assert mine.stdout == "mine\nprofile\n"
    finally:
        await member.close()
    await backend.drop(snapshot)


async def test_members_are_independent_and_a_member_can_be_snapshotted(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task(SLOW_SETUP.replace("RUN sleep 2\n", ""))
    source = await backend.start(task, lifetime_s=60)
    try:
        snapshot = await backend.snapshot(source)
    finally:
        await source.close()
    first = await backend.start_from(snapshot, task, lifetime_s=60)
    second = await backend.start_from(snapshot, task, lifetime_s=60)
    try:
        await first.exec("echo first >> built.txt && rm -f /logs/agent/none && mkdir -p /logs/agent/run")
        await second.exec("rm built.txt")
        assert (await first.exec("cat built.txt")).stdout == "built\nfirst\n"
        assert await first.read_file("built.txt") == b"built\nfirst\n"
        assert (await second.exec("ls /app; ls /logs/agent")).stdout == ""
        again = await backend.snapshot(first)  # a member's files as it sees them, its layer included
        third = await backend.start_from(again, task, lifetime_s=60)
        try:
            assert (await third.exec("cat built.txt; ls /logs/agent")).stdout == "built\nfirst\nrun\n"
        finally:
            await third.close()
        await backend.drop(again)
    finally:
        await first.close()
        await second.close()
    await backend.drop(snapshot)


async def test_closing_a_member_leaves_no_mount_and_nothing_but_the_snapshot(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    host_mounts = _host_mounts_of(backend)
    task = make_task(allow_internet=False)
    source = await backend.start(task, lifetime_s=60)
    snapshot = await backend.snapshot(source)
    await source.close()
    member = await backend.start_from(snapshot, task, lifetime_s=60)
    try:
        own_network = await member.exec("readlink /proc/self/ns/net")
        assert own_network.stdout.strip() != os.readlink("/proc/self/ns/net"), "no network of its own"
        await member.exec("echo x > /app/file && echo y > /logs/verifier/reward.txt")
        assert _host_mounts_of(backend) == host_mounts
    finally:
        await member.close()
    assert not member.root.exists()
    assert _host_mounts_of(backend) == host_mounts
    assert os.listdir(backend.base_dir) == [snapshot.id]
    await backend.drop(snapshot)
    await backend.drop(snapshot)
    assert os.listdir(backend.base_dir) == []


async def test_snapshots_left_by_a_dead_owner_are_swept_but_live_ones_kept(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    base = tmp_path / "sandboxes"
    (base / "ht-snap-0123456789ab" / "fs" / "app").mkdir(parents=True)
    (base / "ht-snap-0123456789ab" / ".lock").touch()  # nobody holds it: its owner is gone
    (base / "ht-snap-unrelated").mkdir()
    first = LocalSandboxBackend(base)
    source = await first.start(make_task(), lifetime_s=60)
    live = await first.snapshot(source)
    await source.close()
    second = LocalSandboxBackend(base)
    other = await second.start(make_task(), lifetime_s=60)
    try:
        assert not (base / "ht-snap-0123456789ab").exists()
        assert (base / live.id).exists() and (base / "ht-snap-unrelated").exists()
    finally:
        await other.close()
        await first.aclose()
    assert not (base / live.id).exists()
