"""E2B sandboxes are labelled with their run: a server restarted on the same run kills what a dead one left,
and ``harness-trainer e2b cleanup --run ID`` does it by hand. Against the fake E2B cloud, whose ``list`` and
class-level ``kill`` are bound to the real SDK's signatures here."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
from pathlib import Path

import pytest
from e2b import AsyncSandbox, SandboxException

from harness_trainer.cli import build_parser
from harness_trainer.jobs.plan import RUN_ID_ENV
from harness_trainer.launch.e2b_commands import _e2b_cleanup, _e2b_cleanup_run
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.e2b_runs import OWNER_KEY, RUN_KEY, TASK_KEY
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_e2b import FakeE2BCloud

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon


def backend(cloud: FakeE2BCloud, run_id: str | None) -> E2BSandboxBackend:
    return E2BSandboxBackend(
        template="t", sandbox_class=cloud, run_id=run_id, kill_grace_s=0.5, retry_backoff_s=0
    )


async def test_a_server_killed_with_8_sandboxes_alive_leaves_none_once_the_next_one_starts(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    cloud = FakeE2BCloud(tmp_path / "e2b")
    task = make_task()
    other_run = backend(cloud, "run-2")
    kept = await other_run.start(task, lifetime_s=60)
    dead = backend(cloud, "run-1")  # its server is SIGKILLed: nothing closes its sandboxes
    orphans = await asyncio.gather(*(dead.start(task, lifetime_s=60) for _ in range(8)))
    assert {s.sdk_sandbox.metadata[RUN_KEY] for s in orphans} == {"run-1"}
    assert orphans[0].sdk_sandbox.metadata[TASK_KEY] == task.name

    restarted, listed_before = backend(cloud, "run-1"), len(cloud.list_calls)
    fresh = await asyncio.gather(*(restarted.start(task, lifetime_s=60) for _ in range(3)))
    assert all(s.sdk_sandbox.killed for s in orphans)  # every orphan, before the first new sandbox
    assert not any(s.sdk_sandbox.killed for s in fresh) and not kept.sdk_sandbox.killed  # others' kept
    assert len(cloud.list_calls) == listed_before + 1  # three concurrent first starts looked once
    assert {s.sdk_sandbox.metadata[OWNER_KEY] for s in fresh} == {restarted.owner} != {dead.owner}
    for sandbox in [*fresh, kept]:
        await sandbox.close()
    for call in cloud.list_calls:
        inspect.signature(AsyncSandbox.list).bind(**call)
    for call in cloud.kill_calls:
        inspect.signature(AsyncSandbox._cls_kill).bind(**call)  # AsyncSandbox.kill(sandbox_id) on the class


async def test_without_a_run_id_nothing_is_listed_and_a_failed_listing_does_not_stop_starts(
    tmp_path: Path, make_task: TaskFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cloud = FakeE2BCloud(tmp_path / "e2b")
    sandbox = await backend(cloud, None).start(make_task(), lifetime_s=60)
    await sandbox.close()
    assert cloud.list_calls == [] and RUN_KEY not in sandbox.sdk_sandbox.metadata

    def refuse(**_: object) -> None:
        raise SandboxException("fake: listing is down")

    cloud.list = refuse  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.WARNING):
        sandbox = await backend(cloud, "run-3").start(make_task(), lifetime_s=60)
    await sandbox.close()
    assert "E2B run run-3: cannot look for orphaned sandboxes: fake: listing is down" in caplog.text


async def test_cleanup_kills_every_sandbox_of_the_run_and_says_how_many(
    tmp_path: Path,
    make_task: TaskFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cloud = FakeE2BCloud(tmp_path / "e2b")
    task = make_task()
    run = backend(cloud, "run-4")
    doomed = [await run.start(task, lifetime_s=60) for _ in range(2)]
    kept = await backend(cloud, "run-5").start(task, lifetime_s=60)
    args = build_parser().parse_args(["e2b", "cleanup", "--run", "run-4"])
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    assert _e2b_cleanup(args, cloud) == 2 and "E2B_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    assert await _e2b_cleanup_run(args.run, cloud) == 0
    out = capsys.readouterr().out
    assert out.startswith("removed 2 sandboxes (") and out.strip().endswith("and 0 snapshots of run run-4")
    assert all(s.sdk_sandbox.killed for s in doomed) and not kept.sdk_sandbox.killed
    for sandbox in [*doomed, kept]:
        await sandbox.close()


def test_serve_passes_its_run_id_to_the_e2b_backend_and_a_job_passes_the_jobs() -> None:
    from harness_trainer.jobs.job_launcher import build_parser as launcher_parser
    from harness_trainer.jobs.plan import build_plan

    args = build_parser().parse_args(["serve", "--dataset", "d", "--upstream", "u", "--run-id", "r-9"])
    assert args.run_id == "r-9"
    options = launcher_parser().parse_args(["--dataset", "org/tasks"])
    plan = build_plan(options, ["--model", "m", "--sandbox", "local"], {RUN_ID_ENV: "job-7"}, None)
    assert plan.serve.argv[plan.serve.argv.index("--run-id") + 1] == "job-7"
    assert "--run-id" not in build_plan(options, ["--model", "m", "--sandbox", "local"], {}, None).serve.argv
    assert isinstance(args, argparse.Namespace)
