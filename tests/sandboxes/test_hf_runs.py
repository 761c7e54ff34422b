"""HF sandbox jobs are labelled with their run: a server restarted on the same run cancels what a dead one
left, and ``harness-trainer hf cleanup --run ID`` does it by hand. Against the fake Hub
(:mod:`tests.sandboxes.fake_hf`), through ``huggingface_hub``'s own ``HfApi.list_jobs`` / ``cancel_job``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from harness_trainer.cli import build_parser
from harness_trainer.sandboxes.hf import HfSandboxBackend
from harness_trainer.sandboxes.hf_sdk import RUN_LABEL, is_run_pool, pool_name
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_hf import FakeHub

pytestmark = pytest.mark.docker  # the fake's jobs run in images exported from the Docker daemon

IMAGE = "debian:bookworm-slim"


def backend(run_id: str | None, **options: object) -> HfSandboxBackend:
    return HfSandboxBackend(image=IMAGE, kill_grace_s=0.5, retry_backoff_s=0, run_id=run_id, **options)


def listings(hub: FakeHub) -> list[str]:
    """The ``list_jobs`` requests the Hub has answered."""
    return [path for method, path in hub.requests if (method, path) == ("GET", "/api/jobs/fake-user")]


def test_a_pool_name_belongs_to_its_run_only() -> None:
    name = pool_name("a", IMAGE)
    assert is_run_pool(name, "a") and not is_run_pool(name, "b")
    assert not is_run_pool(pool_name("a-0123abcd", IMAGE), "a"), "a run whose id extends another's"
    assert not is_run_pool(None, "a") and not is_run_pool("ht-a-", "a")


async def test_a_server_killed_with_sandboxes_alive_leaves_none_once_the_next_one_starts(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    task = make_task()
    other = backend("run-2")
    kept = await other.start(task, lifetime_s=60)
    dead = backend("run-1")  # its server is SIGKILLed: nothing closes its sandboxes
    orphans = [await dead.start(task, lifetime_s=60) for _ in range(2)]
    assert {fake_hub.jobs[s.id].labels[RUN_LABEL] for s in orphans} == {"run-1"}

    restarted, listed = backend("run-1"), len(listings(fake_hub))
    fresh = await asyncio.gather(*(restarted.start(task, lifetime_s=60) for _ in range(3)))
    try:
        assert {fake_hub.jobs[s.id].stage for s in orphans} == {"CANCELED"}
        assert {job.id for job in fake_hub.running()} == {kept.id, *(s.id for s in fresh)}, "others kept"
        # three concurrent first starts: one token check (one listing) and one reap (two listings)
        assert len(listings(fake_hub)) == listed + 3 and fake_hub.unknown == []
    finally:
        for each in (other, restarted):
            await each.aclose()


async def test_a_dead_servers_pool_hosts_are_cancelled_when_the_next_one_prepares(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    task = make_task()
    dead = backend("run-6", dedicated=False, sandboxes_per_host=1, concurrency=2)
    await dead.prepare(task)  # its server is SIGKILLed: nothing cancels its hosts
    hosts = fake_hub.running(**{"hf-sandbox-pool": pool_name("run-6", IMAGE)})
    assert len(hosts) == 2
    restarted = backend("run-6", dedicated=False, sandboxes_per_host=1, concurrency=1)
    try:
        await restarted.prepare(task)
        assert {job.stage for job in hosts} == {"CANCELED"}
        assert len(fake_hub.running()) == 1, "the restarted server's own host"
    finally:
        await restarted.aclose()
    assert fake_hub.running() == []


async def test_without_a_run_id_nothing_is_reaped_and_a_failed_listing_does_not_stop_starts(
    fake_hub: FakeHub, make_task: TaskFactory, caplog: pytest.LogCaptureFixture
) -> None:
    task = make_task()
    dead = backend("run-3")
    orphan = await dead.start(task, lifetime_s=60)
    unnamed = backend(None)
    sandbox = await unnamed.start(task, lifetime_s=60)
    assert fake_hub.jobs[orphan.id].stage == "RUNNING", "a backend with a fresh run id reaps nothing"
    await unnamed.aclose()

    restarted = backend("run-3")
    await restarted.check_access()
    fake_hub.fail_list_jobs = [400]  # the reaper's listing fails: logged, and the start goes on
    with caplog.at_level(logging.WARNING):
        fresh = await restarted.start(task, lifetime_s=60)
    assert "HF run run-3: cannot look for orphaned sandbox jobs: " in caplog.text
    assert fake_hub.jobs[orphan.id].stage == "RUNNING" and not fresh.closed
    await restarted.aclose()
    await dead.aclose()
    assert sandbox.closed and fake_hub.running() == []


async def test_cleanup_cancels_every_job_of_the_run_and_says_how_many(
    fake_hub: FakeHub,
    make_task: TaskFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    task = make_task()
    run = backend("run-4")
    doomed = [await run.start(task, lifetime_s=60) for _ in range(2)]
    other = backend("run-5")
    kept = await other.start(task, lifetime_s=60)
    args = build_parser().parse_args(["hf", "cleanup", "--run", "run-4"])
    token = fake_hub.token
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("harness_trainer.sandboxes.hf.stored_login", lambda: False)
    assert args.func(args) == 2 and "HF_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "hf_someone_elses")
    assert args.func(args) == 1
    assert capsys.readouterr().err.startswith("error: cannot list the HF sandbox jobs of run run-4: ")
    monkeypatch.setenv("HF_TOKEN", token)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out == f"cancelled 2 HF sandbox jobs of run run-4: {doomed[0].id}, {doomed[1].id}\n"
    assert {fake_hub.jobs[s.id].stage for s in doomed} == {"CANCELED"}
    assert fake_hub.jobs[kept.id].stage == "RUNNING"
    assert args.func(args) == 0 and capsys.readouterr().out == "cancelled 0 HF sandbox jobs of run run-4\n"
    await run.aclose()
    await other.aclose()
