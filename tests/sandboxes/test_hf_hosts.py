"""A job that ends under the hf backend's sandboxes (:mod:`harness_trainer.sandboxes.hf_hosts`), against the
fake Hub (:mod:`tests.sandboxes.fake_hf`), whose :meth:`~tests.sandboxes.fake_hf.FakeHub.end_job` ends a job
as the Hub would (its stage reported, its server gone): the sandboxes on it fail with a SandboxError naming
why, the run's next start gets a working sandbox (the pool keeps a dead host it booted, so the backend drops
it), and no job is left running."""

from __future__ import annotations

import asyncio

import pytest

from harness_trainer.sandboxes.base import SandboxError
from harness_trainer.sandboxes.hf import HfSandboxBackend
from harness_trainer.sandboxes.hf_sdk import pool_name
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_hf import FakeHub

pytestmark = pytest.mark.docker  # the fake's jobs run in images exported from the Docker daemon

IMAGE = "debian:bookworm-slim"


def pooled(**options: object) -> HfSandboxBackend:
    """Pooled sandboxes, one host to start with and room on it for more than the test makes."""
    return HfSandboxBackend(
        dedicated=False, image=IMAGE, sandboxes_per_host=4, concurrency=1, kill_grace_s=0.5,
        retry_backoff_s=0, run_id="run-h", **options,
    )  # fmt: skip


async def test_a_pool_host_that_dies_fails_its_sandboxes_by_name_and_the_next_start_gets_a_new_host(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    """The host dies before any of its sandboxes notices: the next start is placed on it by the pool (it
    has free slots), fails, and goes to a new host; then each sandbox on the dead one says why it failed."""
    backend, task = pooled(), make_task()
    try:
        first = await backend.create_sandbox(task, lifetime_s=60)
        second = await backend.create_sandbox(task, lifetime_s=60)
        (host,) = fake_hub.running()
        assert first.job_id == second.job_id == host.id and first.pooled
        fake_hub.end_job(host.id, "ERROR", "the VM was lost")

        fresh = await backend.create_sandbox(task, lifetime_s=60)
        assert fresh.job_id != host.id and (await fresh.exec("echo ok", cwd="~")).stdout == "ok\n"
        dead = rf"its host job {host.id} has ended \(ERROR: the VM was lost\)"
        with pytest.raises(SandboxError, match=rf"^sandbox {first.id}: unreachable: {dead}"):
            await first.exec("true", cwd="~")
        with pytest.raises(SandboxError, match=rf"^sandbox {second.id}: cannot write ~/a: {dead}"):
            await second.write_file("~/a", "x")
        with pytest.raises(SandboxError, match=dead):
            await second.read_file("~/a")
        await first.close()  # nothing to kill: the job took it with it
        assert backend.pools[IMAGE].host_ids == [fresh.job_id]
    finally:
        await backend.aclose()
    assert fake_hub.running() == [], "no job left running"
    assert fake_hub.jobs[host.id].stage == "ERROR", "an ended host is not cancelled again"
    assert len(fake_hub.running(**{"hf-sandbox-pool": pool_name("run-h", IMAGE)})) == 0


async def test_a_command_running_when_its_host_completes_fails_naming_it_and_later_starts_work(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    """A command in flight loses its connection when the host ends; its error names the end, and the host
    is dropped from the pool then, so the next start does not even try it."""
    backend, task = pooled(), make_task()
    try:
        sandbox = await backend.create_sandbox(task, lifetime_s=60)
        running = asyncio.ensure_future(sandbox.exec("sleep 30", timeout_s=60, cwd="~"))
        await asyncio.sleep(0.5)
        fake_hub.end_job(sandbox.job_id, "COMPLETED")
        with pytest.raises(SandboxError, match=r"has ended \(COMPLETED\)"):
            await asyncio.wait_for(running, 20)
        assert backend.pools[IMAGE].host_ids == []
        posts = len(fake_hub.requests)
        later = await asyncio.gather(*(backend.create_sandbox(task, lifetime_s=60) for _ in range(3)))
        assert len({s.job_id for s in later}) == 1 and sandbox.job_id not in {s.job_id for s in later}
        assert [(await s.exec("true", cwd="~")).exit_code for s in later] == [0, 0, 0]
        assert not [p for _, p in fake_hub.requests[posts:] if p.startswith(f"/{sandbox.job_id}--")]
    finally:
        await backend.aclose()
    assert fake_hub.running() == []


async def test_a_dedicated_sandbox_whose_job_ended_says_so(fake_hub: FakeHub, make_task: TaskFactory) -> None:
    backend = HfSandboxBackend(image=IMAGE, kill_grace_s=0.5, retry_backoff_s=0)
    try:
        sandbox = await backend.start(make_task(), lifetime_s=60)
        fake_hub.end_job(sandbox.id, "ERROR", "out of memory")
        with pytest.raises(SandboxError, match=rf"its job {sandbox.id} has ended \(ERROR: out of memory\)"):
            await sandbox.exec("true")
        assert (await backend.start(make_task(), lifetime_s=60)).id != sandbox.id
    finally:
        await backend.aclose()
    assert fake_hub.running() == []
