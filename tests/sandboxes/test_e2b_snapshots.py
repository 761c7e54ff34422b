"""The E2B backend's snapshots (one setup per GRPO group) against the fake E2B cloud: what a member holds, how
a run's snapshots are named and reaped, and how E2B's failures surface. The contract itself is
test_fork_contract's; the SDK signatures of these calls are bound in test_e2b."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("e2b")

from e2b import SandboxNotFoundException

from harness_trainer.launch.e2b_commands import _e2b_cleanup_run
from harness_trainer.rollouts.result import RolloutOptions
from harness_trainer.rollouts.server.group_setup import GroupSetups, Start
from harness_trainer.rollouts.server.sandbox_meter import SandboxMeter
from harness_trainer.sandboxes.base import Sandbox, SandboxError, SandboxStartError
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.e2b_runs import OWNER_KEY, RUN_KEY, TASK_KEY, snapshot_name, snapshot_owner
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_e2b import FakeE2BCloud, FakeLatency, api_error

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon


@pytest.fixture
def cloud(tmp_path: Path) -> FakeE2BCloud:
    return FakeE2BCloud(tmp_path / "e2b")


def make_backend(cloud: FakeE2BCloud, run_id: str | None = "run-1") -> E2BSandboxBackend:
    return E2BSandboxBackend(
        template="t", sandbox_class=cloud, run_id=run_id, kill_grace_s=0.5, retry_backoff_s=0.01
    )


@pytest.fixture
async def backend(cloud: FakeE2BCloud) -> AsyncIterator[E2BSandboxBackend]:
    started = make_backend(cloud)
    yield started
    leaked = started.live
    await started.aclose()
    assert not leaked and not started.snapshots


async def test_what_the_setup_did_outside_the_private_paths_is_in_every_member(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    task = make_task()
    source = await backend.start(task, lifetime_s=60)
    setup = await source.exec("mkdir -p /opt/x && echo installed > /opt/x/agent && rm /etc/issue")
    assert setup.exit_code == 0, setup.stderr
    snapshot = await backend.snapshot(source)
    await source.close()
    members = await asyncio.gather(
        *(backend.start_from(snapshot, task, lifetime_s=60, env={"M": str(n)}) for n in range(3))
    )
    try:
        for member in members:
            seen = await member.exec("cat /opt/x/agent; test -e /etc/issue || echo removed; echo $M")
            assert seen.stdout == f"installed\nremoved\n{member.sdk_sandbox.envs['M']}\n", seen.stderr
    finally:
        for member in members:
            await member.close()
    # E2B named the snapshot for the run and this backend, and created each member from its id with the
    # run's metadata, the lifetime and the env, as a start from a template.
    (taken,) = [kwargs for name, kwargs in cloud.sandboxes[0].calls if name == "create_snapshot"]
    assert taken["name"] == snapshot_name("run-1", backend.owner, 1)
    assert snapshot.source == source.id and snapshot.task_name == task.name
    first, *from_snapshot = cloud.create_calls
    assert [call["template"] for call in from_snapshot] == [snapshot.id] * 3
    assert all(call["timeout"] == first["timeout"] for call in from_snapshot)
    assert from_snapshot[0]["metadata"] == {TASK_KEY: task.name, OWNER_KEY: backend.owner, RUN_KEY: "run-1"}
    assert sorted(call["envs"]["M"] for call in from_snapshot) == ["0", "1", "2"]
    await backend.drop(snapshot)
    assert cloud.snapshots.live == {}


async def test_a_dead_runs_snapshots_are_deleted_by_the_next_backends_reaping_and_by_cleanup(
    cloud: FakeE2BCloud, make_task: TaskFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    task = make_task()
    dead, other = make_backend(cloud, "run-1"), make_backend(cloud, "run-1-b")  # a prefix is not a match
    for server in (dead, other):  # each takes a snapshot; the first is then SIGKILLed (nothing dropped)
        source = await server.start(task, lifetime_s=60)
        await server.snapshot(source)
        await source.close()
    (orphan,), (kept,) = dead.snapshots, other.snapshots

    restarted = make_backend(cloud, "run-1")
    sandbox = await restarted.start(task, lifetime_s=60)
    assert orphan.id not in cloud.snapshots.live and kept.id in cloud.snapshots.live
    mine = await restarted.snapshot(sandbox)
    await sandbox.close()

    assert await _e2b_cleanup_run("run-1", cloud) == 0  # the restarted server's own, by hand
    assert capsys.readouterr().out.strip().endswith(f"and 1 snapshot ({mine.id}) of run run-1")
    assert mine.id not in cloud.snapshots.live and kept.id in cloud.snapshots.live
    await restarted.aclose()  # its snapshot is already gone: no error
    await other.aclose()
    assert cloud.snapshots.live == {}


def test_a_snapshot_name_carries_its_run_and_owner_and_is_a_valid_e2b_name() -> None:
    owner = "0123456789abcdef"
    for run in ("run-1", "Job_7/x.y", "r" * 80, "---"):
        name = snapshot_name(run, owner, 3)
        assert name.startswith("ht-snap-") and len(name) <= 80
        assert all(c.isdigit() or c == "-" or "a" <= c <= "z" for c in name), name
        for listed in (name, f"project/{name}:v2"):
            assert snapshot_owner(listed, run) == owner
    assert snapshot_name("run-1", owner, 3) == f"ht-snap-run-1-{owner}-3"
    assert snapshot_owner(snapshot_name("run-1-b", owner, 1), "run-1") is None
    assert snapshot_owner(snapshot_name("job_7", owner, 1), "Job_7") is None  # one slug, two runs
    assert snapshot_owner(snapshot_name(None, owner, 1), "run-1") is None
    assert snapshot_owner("ht-abcdef", "run-1") is None  # a template of the project, not a snapshot


async def test_a_snapshot_e2b_refuses_raises_a_sandbox_error_with_its_answer(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    source = await backend.start(make_task(), lifetime_s=60)
    cloud.snapshots.failures.append(api_error(500, "fake: snapshot storage is down"))
    try:
        with pytest.raises(SandboxError, match="fake: snapshot storage is down"):
            await backend.snapshot(source)
    finally:
        await source.close()
    with pytest.raises(SandboxError, match="not an open sandbox"):
        await backend.snapshot(source)
    assert backend.snapshots == [] and cloud.snapshots.live == {}


async def test_a_failing_create_from_a_snapshot_raises_a_start_error_after_the_retry_schedule(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    task = make_task()
    source = await backend.start(task, lifetime_s=60)
    snapshot = await backend.snapshot(source)
    await source.close()
    cloud.create_failures = [api_error(503, "fake: no capacity")] * 3
    with pytest.raises(SandboxStartError, match=rf"snapshot '{snapshot.id}'\) did not start after 3 tries"):
        await backend.start_from(snapshot, task, lifetime_s=60)
    assert [call["template"] for call in cloud.create_calls[1:]] == [snapshot.id] * 3
    cloud.snapshots.delete(snapshot.id)  # deleted behind the backend's back: E2B's 404, not retried
    with pytest.raises(SandboxStartError, match=r"refused .* after 1 try; last error: template not found"):
        await backend.start_from(snapshot, task, lifetime_s=60)
    await backend.drop(snapshot)
    with pytest.raises(SandboxStartError, match="not this backend's"):  # refused before any request
        await backend.start_from(snapshot, task, lifetime_s=60)
    assert len(cloud.create_calls) == 5 and not backend.live


async def test_a_failed_delete_is_logged_and_a_cancelled_snapshot_is_deleted_once_taken(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, caplog: pytest.LogCaptureFixture
) -> None:
    source = await backend.start(make_task(), lifetime_s=60)
    try:
        snapshot = await backend.snapshot(source)
        deleting = cloud.delete_snapshot

        async def refuse(snapshot_id: str, **opts: object) -> bool:
            raise api_error(500, "fake: deletes are down")

        cloud.delete_snapshot = refuse  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING):
            await backend.drop(snapshot)  # never raises
        assert f"E2B snapshot {snapshot.id}: delete failed" in caplog.text and backend.snapshots == []
        cloud.delete_snapshot = deleting  # type: ignore[method-assign]
        assert await cloud.delete_snapshot(snapshot.id) is True  # what the run's cleanup would do
        assert await cloud.delete_snapshot(snapshot.id) is False  # E2B's 404: the SDK answers False

        cloud.latency = FakeLatency(snapshot_s=0.5)
        taking = asyncio.ensure_future(backend.snapshot(source))
        await asyncio.sleep(0.1)  # E2B is taking it
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking
        for _ in range(100):  # E2B takes it all the same; the backend deletes it once taken
            if len(cloud.snapshots.deleted) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await source.close()
    assert cloud.snapshots.live == {} and len(cloud.snapshots.deleted) == 2 and backend.snapshots == []


async def test_the_fakes_snapshots_answer_as_e2b_does(cloud: FakeE2BCloud, make_task: TaskFactory) -> None:
    """The fake's listing filters (source sandbox, one name or id) and the snapshot of a killed sandbox."""
    backend = make_backend(cloud, None)
    source = await backend.start(make_task(), lifetime_s=60)
    try:
        first = await source.sdk_sandbox.create_snapshot(name="named")
        second = await source.sdk_sandbox.create_snapshot()
    finally:
        await source.close()
    assert first.snapshot_id != second.snapshot_id and first.names == ["fake-project/named:v1"]

    async def listed(**query: object) -> list[str]:
        paginator = cloud.list_snapshots(limit=1, **query)  # type: ignore[arg-type]
        found = []
        while paginator.has_next:
            found += [info.snapshot_id for info in await paginator.next_items()]
        return found

    assert await listed() == [first.snapshot_id, second.snapshot_id]
    for name in ("named", "fake-project/named", first.names[0], first.snapshot_id):
        assert await listed(name=name) == [first.snapshot_id], name
    assert await listed(sandbox_id=source.id) == [first.snapshot_id, second.snapshot_id]
    assert await listed(sandbox_id="fake-other") == []
    with pytest.raises(SandboxNotFoundException):  # the SDK's answer for a sandbox that is gone
        await source.sdk_sandbox.create_snapshot(name="late")
    for snapshot in (first, second):
        assert await cloud.delete_snapshot(snapshot.snapshot_id) is True
    await backend.aclose()


class MarkingHarness:
    """What a group's setup needs of a harness: an install (it leaves a mark to be found in each member)."""

    def __init__(self) -> None:
        self.installs = 0

    async def install(self, sandbox: Sandbox) -> None:
        self.installs += 1
        done = await sandbox.exec("mkdir -p /opt/agent && echo installed > /opt/agent/mark")
        assert done.exit_code == 0, done.stderr


async def test_a_group_whose_fork_fails_half_way_starts_that_member_cold_and_leaves_nothing(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    """Issue 42's half-way fork in this design: each member is its own create from the group's snapshot,
    so when one of them fails after others were made, the made ones run on (they are independent) and the
    failed member starts cold with the reason; no sandbox or snapshot outlives the group."""
    task, harness, setups, meter = make_task(), MarkingHarness(), GroupSetups(linger_s=0.05), SandboxMeter()
    refused = api_error(404, "snapshot not found")
    # The setup's create, then the four members' creates from the snapshot (one refused: never retried),
    # then the refused member's cold create.
    cloud.create_failures = [None, None, None, refused, None, None]

    async def member(m: int) -> Start:
        options = RolloutOptions(harness="toy", sandbox="e2b", episode_id=f"group0-member{m}")
        return await setups.start(backend, task, options, harness, meter, lifetime_s=60)  # type: ignore[arg-type]

    starts = await asyncio.gather(*(member(m) for m in range(4)))
    try:
        forked = [start for start in starts if start.snapshot is not None]
        (cold,) = [start for start in starts if start.snapshot is None]
        assert len(forked) == 3 and len({start.snapshot for start in forked}) == 1 and harness.installs == 1
        assert (
            cold.note is not None
            and "starting from snapshot" in cold.note
            and "snapshot not found" in cold.note
        )
        for start in forked:  # made from the one setup: the install is there, not done again
            seen = await start.sandbox.exec("cat /opt/agent/mark")
            assert seen.stdout == "installed\n", seen.stderr
        assert (await cold.sandbox.exec("test -e /opt/agent/mark")).exit_code == 1  # cold: its own install
        templates = [call["template"] for call in cloud.create_calls]
        assert templates.count("t") == 2 and templates.count(forked[0].snapshot) == 4
    finally:
        for start in starts:
            await meter.close(start.sandbox)
            setups.closed(start.sandbox)
        await setups.aclose()
    assert not backend.live and not backend.snapshots and cloud.snapshots.live == {}
    assert all(sandbox.killed for sandbox in cloud.sandboxes)
