"""The forking contract (:class:`~harness_trainer.sandboxes.base.ForkingBackend`), run against every backend
whose ``capabilities.forks`` is True: local and Docker for real, E2B against the SDK fake.

Each test is one promise of the protocol's docstrings: a snapshot holds the files of the sandbox it was taken
from (its workdir, HOME and what a setup installed elsewhere), each sandbox started from it is independent of
the others, of the snapshot and of its source, and dropping is idempotent and leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.sandboxes import SANDBOXES
from harness_trainer.sandboxes.base import ForkingBackend, SandboxStartError
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.test_contract import CONTRACT_BACKENDS, NEEDS

FORKING = sorted(name for name, cls in SANDBOXES.items() if cls.capabilities.forks)


def test_the_backends_that_can_fork_say_so() -> None:
    assert {"local", "docker", "e2b"} <= set(FORKING)
    assert "hf" not in FORKING  # huggingface_hub's sandboxes offer no snapshot


@pytest.fixture(params=[pytest.param(name, marks=NEEDS.get(name, ())) for name in FORKING])
async def forking(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ForkingBackend]:
    started: Any = CONTRACT_BACKENDS[request.param](tmp_path)
    yield started
    leaked, held = started.live, started.snapshots
    await started.aclose()
    assert not leaked, f"the test left sandboxes open: {[s.id for s in leaked]}"
    assert not held, f"the test left snapshots: {[s.id for s in held]}"
    assert not started.snapshots, "aclose left snapshots"


async def _set_up(backend: ForkingBackend, make_task: TaskFactory) -> Any:
    """A source sandbox with a setup's marks in its workdir and its HOME (the local backend shares the rest
    of this machine's files, so paths outside its private ones are each backend's own test)."""
    task = make_task()
    source = await backend.start(task, lifetime_s=120)
    ran = await source.exec(
        "echo repo > /app/checkout.txt && mkdir -p ~/.config/agent && echo cfg > ~/.config/agent/c.json"
    )
    assert ran.exit_code == 0, ran.stderr
    return task, source


async def test_a_sandbox_started_from_a_snapshot_has_the_sources_files(
    forking: ForkingBackend, make_task: TaskFactory
) -> None:
    task, source = await _set_up(forking, make_task)
    try:
        snapshot = await forking.snapshot(source)
        assert snapshot.source == source.id and snapshot.task_name == task.name
        assert snapshot in forking.snapshots
        member = await forking.start_from(snapshot, task, lifetime_s=120)
        try:
            assert member.id != source.id and member.workdir == "/app"
            read = await member.exec("cat /app/checkout.txt ~/.config/agent/c.json; pwd")
            assert (read.exit_code, read.stdout) == (0, "repo\ncfg\n/app\n"), read.stderr
            for path in ("/logs/agent", "/logs/verifier", "/tests", "/solution"):
                assert (await member.exec(f"test -d {path}")).exit_code == 0, path
            await member.write_file("written.txt", "by the member")
            assert await member.read_file("/app/written.txt") == b"by the member"
        finally:
            await member.close()
        await forking.drop(snapshot)
        assert snapshot not in forking.snapshots
    finally:
        await source.close()


async def test_members_are_independent_of_each_other_the_snapshot_and_the_source(
    forking: ForkingBackend, make_task: TaskFactory
) -> None:
    task, source = await _set_up(forking, make_task)
    members = []
    try:
        snapshot = await forking.snapshot(source)
        await source.exec("echo later > /app/after-snapshot.txt")  # after the snapshot: in no member
        members = [await forking.start_from(snapshot, task, lifetime_s=120) for _ in range(3)]
        first, second, third = members
        await first.exec("echo one > /app/checkout.txt && rm ~/.config/agent/c.json && touch /app/mine")
        await second.exec("echo two > /app/checkout.txt")
        assert (await first.exec("cat /app/checkout.txt")).stdout == "one\n"
        assert (await second.exec("cat /app/checkout.txt; cat ~/.config/agent/c.json")).stdout == "two\ncfg\n"
        untouched = await third.exec("cat /app/checkout.txt; ls /app")
        assert untouched.stdout == "repo\ncheckout.txt\n", untouched.stdout
        assert (await source.exec("cat /app/checkout.txt")).stdout == "repo\n"
        late = await forking.start_from(snapshot, task, lifetime_s=120)  # the snapshot itself is unchanged
        members.append(late)
        assert (await late.exec("cat /app/checkout.txt; ls /app")).stdout == "repo\ncheckout.txt\n"
    finally:
        for member in members:
            await member.close()
        await source.close()
    await forking.drop(snapshot)


async def test_a_snapshot_outlives_its_source_and_drop_is_idempotent(
    forking: ForkingBackend, make_task: TaskFactory
) -> None:
    task, source = await _set_up(forking, make_task)
    try:
        snapshot = await forking.snapshot(source)
    finally:
        await source.close()
    member = await forking.start_from(snapshot, task, lifetime_s=120)
    try:
        assert (await member.exec("cat /app/checkout.txt")).stdout == "repo\n"
    finally:
        await member.close()
    await forking.drop(snapshot)
    await forking.drop(snapshot)  # idempotent, never raises
    with pytest.raises(SandboxStartError):
        await forking.start_from(snapshot, task, lifetime_s=120)


async def test_aclose_drops_the_snapshots_still_held(forking: ForkingBackend, make_task: TaskFactory) -> None:
    _, source = await _set_up(forking, make_task)
    try:
        await forking.snapshot(source)
        await forking.snapshot(source)
    finally:
        await source.close()
    assert len(forking.snapshots) == 2
    await forking.aclose()
    assert forking.snapshots == []
