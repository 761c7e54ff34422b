"""One setup per GRPO group (:mod:`harness_trainer.rollouts.server.group_setup`), on the real local backend
with the real toy agent and a scripted dev engine.

The task's Dockerfile has a ``RUN`` step that appends a line to ``/app/setups.log``: the local backend runs it
at every cold start, so the number of lines a member sees says how many setups its sandbox came from. Each
member's one command writes a file of its own and copies what it saw; the verifier rewards 1 only when the
member sees one setup and no other member's file (members are independent).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness_trainer.rollouts.result import RolloutOptions, RolloutResult
from harness_trainer.rollouts.server.group_setup import GroupSetups
from harness_trainer.rollouts.server.run import run_rollout
from harness_trainer.sandboxes.base import Sandbox, SandboxError, SandboxSnapshot
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.task import HarborTask
from tests.rollouts.conftest import bash_call

MEMBER_COMMAND = (
    "ls /app > /logs/agent/seen.txt; cat /app/setups.log >> /logs/agent/seen.txt; touch /app/m-$$"
)
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
setups=$(wc -l < /app/setups.log)
members=$(ls /app | grep -c '^m-')
cat /logs/agent/seen.txt
echo "setups $setups members $members"
ok=0; if [ "$setups" = 1 ] && [ "$members" = 1 ]; then ok=1; fi
echo $ok > /logs/verifier/reward.txt
"""


def setup_task(tmp_path: Path) -> HarborTask:
    folder = tmp_path / "setup-once"
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "task.toml").write_text(
        'version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n'
    )
    (folder / "instruction.md").write_text("Leave a mark in /app.\n")
    (folder / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nRUN echo setup >> /app/setups.log\n"
    )
    (folder / "tests" / "test.sh").write_text(TEST_SH)
    return load_task(folder, split="train")


def member(m: int, group: int = 0) -> RolloutOptions:
    return RolloutOptions(
        harness="toy", sandbox="local", agent_step_limit=1, episode_id=f"group{group}-member{m}"
    )


def assert_member_of_one_setup(result: RolloutResult) -> None:
    assert result.error is None, result.error
    assert result.reward == 1.0, result.log_tail[-2000:]


async def group_member(
    runtime: Any, task: HarborTask, m: int, backend: LocalSandboxBackend, setups: GroupSetups
) -> RolloutResult:
    """Member ``m`` of group 0 run on ``backend`` with ``setups``, through ``runtime``'s capture proxy."""
    capture, model = runtime.capture, runtime.model
    return await run_rollout(task, member(m), capture=capture, backend=backend, model=model, setups=setups)


class Failing(LocalSandboxBackend):
    """The real local backend whose snapshot, or some starts from a snapshot, fail on demand."""

    def __init__(self, base_dir: Path, *, snapshot_fails: bool = False, start_from_fails: int = 0) -> None:
        super().__init__(base_dir, kill_grace_s=0.5)
        self.snapshot_fails, self.start_from_fails = snapshot_fails, start_from_fails

    async def snapshot(self, sandbox: Sandbox) -> SandboxSnapshot:
        if self.snapshot_fails:
            raise SandboxError("the disk is full")
        return await super().snapshot(sandbox)

    async def start_from(self, snapshot: SandboxSnapshot, task: HarborTask, **kwargs: Any) -> Sandbox:
        if self.start_from_fails:
            self.start_from_fails -= 1
            raise SandboxError("no capacity for a fork")
        return await super().start_from(snapshot, task, **kwargs)


async def test_a_group_is_set_up_once_and_its_members_start_from_the_snapshot(
    runtime_for: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    task = setup_task(tmp_path)
    runtime = await runtime_for([bash_call(MEMBER_COMMAND)] * 4)
    results = await asyncio.gather(*(runtime.rollout(task, member(m)) for m in range(3)))
    for result in results:
        assert_member_of_one_setup(result)
        assert "install" not in result.phase_seconds  # the agent came installed in the snapshot
    snapshots = {result.snapshot for result in results}
    assert len(snapshots) == 1 and None not in snapshots
    assert all(result.group_setup_note is None for result in results)
    backend = runtime.backend("local")
    assert [s.id for s in backend.snapshots] == list(snapshots)  # held for a late member (the linger)
    late = await runtime.rollout(task, member(3))
    assert_member_of_one_setup(late)
    assert late.snapshot in snapshots
    await runtime.setups.aclose()
    assert backend.snapshots == []


async def test_rollouts_outside_a_group_or_with_group_setup_off_start_cold(
    runtime_for: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    task = setup_task(tmp_path)
    runtime = await runtime_for([bash_call(MEMBER_COMMAND)] * 2)
    evaluation = RolloutOptions(harness="toy", sandbox="local", agent_step_limit=1, episode_id="eval-3")
    cold = await runtime.rollout(task, evaluation)
    assert_member_of_one_setup(cold)  # its own RUN step, once
    assert cold.snapshot is None and "install" in cold.phase_seconds
    runtime.setups = None  # as RuntimeConfig(group_setup=False) makes it
    off = await runtime.rollout(task, member(0))
    assert_member_of_one_setup(off)
    assert off.snapshot is None and runtime.backend("local").snapshots == []


async def test_a_failed_setup_starts_the_whole_group_cold_with_the_reason(
    runtime_for: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    task = setup_task(tmp_path)
    runtime = await runtime_for([bash_call(MEMBER_COMMAND)] * 3)
    backend, setups = Failing(tmp_path / "sandboxes", snapshot_fails=True), GroupSetups()
    try:
        results = await asyncio.gather(*(group_member(runtime, task, m, backend, setups) for m in range(3)))
        for result in results:
            assert_member_of_one_setup(result)  # a cold start: its own RUN step, once
            assert result.snapshot is None and "install" in result.phase_seconds
            note = result.group_setup_note or ""
            assert "the group's setup failed: SandboxError: the disk is full" in note
        assert backend.live == [] and backend.snapshots == []  # the setup's sandbox was closed
    finally:
        await setups.aclose()
        await backend.aclose()


async def test_a_member_whose_start_from_the_snapshot_fails_starts_cold_and_the_others_go_on(
    runtime_for: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    task = setup_task(tmp_path)
    runtime = await runtime_for([bash_call(MEMBER_COMMAND)] * 3)
    backend, setups = Failing(tmp_path / "sandboxes", start_from_fails=1), GroupSetups(linger_s=0.05)
    try:
        results = await asyncio.gather(*(group_member(runtime, task, m, backend, setups) for m in range(3)))
        for result in results:
            assert_member_of_one_setup(result)
        cold = [r for r in results if r.snapshot is None]
        assert len(cold) == 1 and "no capacity for a fork" in (cold[0].group_setup_note or "")
        assert len({r.snapshot for r in results if r.snapshot is not None}) == 1
        for _ in range(100):  # the linger runs out once every member closed: the snapshot is dropped
            if not backend.snapshots:
                break
            await asyncio.sleep(0.05)
        assert backend.snapshots == []
    finally:
        await setups.aclose()
        await backend.aclose()


async def test_the_snapshot_is_on_the_result_as_it_goes_over_the_wire(
    runtime_for: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    task = setup_task(tmp_path)
    runtime = await runtime_for([bash_call(MEMBER_COMMAND)] * 2)
    first = await runtime.rollout(task, member(0))
    second = await runtime.rollout(task, member(1))
    assert first.snapshot == second.snapshot is not None
    record = json.loads(first.model_dump_json())
    assert record["snapshot"] == first.snapshot and record["sandbox_seconds"] > 0


async def test_a_kind_of_group_whose_setup_costs_less_than_forking_starts_cold_from_then_on(
    runtime_for: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    """The toy agent's install and this task's one RUN line take less than a snapshot and the starts from
    it save: the first group forks and its measurement sends the next group's members to cold starts."""
    task = setup_task(tmp_path)
    runtime = await runtime_for([bash_call(MEMBER_COMMAND)] * 6)
    first = await asyncio.gather(*(runtime.rollout(task, member(m, group=0)) for m in range(3)))
    assert all(result.snapshot is not None for result in first)
    (costs,) = runtime.setups.costs.values()
    assert len(costs.starts_s) == 3 and costs.pays() is False, costs
    second = await asyncio.gather(*(runtime.rollout(task, member(m, group=1)) for m in range(3)))
    for result in second:
        assert_member_of_one_setup(result)  # its own RUN step, once
        assert result.snapshot is None and "install" in result.phase_seconds
        assert "one setup per group does not pay for this task" in (result.group_setup_note or "")


def test_one_setup_pays_when_g_minus_1_setups_outweigh_a_snapshot_and_g_starts() -> None:
    from harness_trainer.rollouts.server.group_setup import Costs

    assert Costs(30.0, 2.0, [1.0]).pays() is None  # one member: nothing to judge yet
    assert Costs(30.0, 2.0, [1.0] * 8).pays() is True  # 7 x 30 s saved against 2 + 8 s
    assert Costs(0.5, 0.2, [0.6] * 4).pays() is False  # 1.5 s saved against 2.6 s
