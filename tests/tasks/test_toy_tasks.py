"""Every shipped toy task, for real in a local sandbox: untouched it is not solved, its solution solves it.

This is also the end-to-end test of ``run_verifier``: the task's Dockerfile prepares the workspace, the
verifier's ``tests/`` is uploaded to ``/tests`` and ``bash /tests/test.sh`` writes the reward file.
"""

from __future__ import annotations

import pytest

from harness_trainer.rollouts.server.verifier import VerifierOutcome, run_verifier
from harness_trainer.sandboxes import LocalSandboxBackend, Sandbox
from harness_trainer.sandboxes.rootless import unavailable
from harness_trainer.tasks import HarborTask, LocalTaskSource, load_task

from .conftest import EXAMPLES, TaskWriter

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no local sandbox here: {unavailable()}")

SOURCE = LocalTaskSource(EXAMPLES)
TOY_TASKS = [task for split in SOURCE.splits() for task in SOURCE.tasks(split)]
WORKDIR = "/app"  # every toy task's Dockerfile says so (test_loader checks it)


async def solve(sandbox: Sandbox, task: HarborTask) -> None:
    assert task.solution is not None
    await sandbox.upload_dir(task.solution.parent, "/solution")
    result = await sandbox.exec("bash /solution/solve.sh", timeout_s=60, cwd=WORKDIR)
    assert result.exit_code == 0, result.stdout + result.stderr


async def verify(backend: LocalSandboxBackend, task: HarborTask, *, solved: bool) -> VerifierOutcome:
    sandbox = await backend.start(task, lifetime_s=120)
    try:
        if solved:
            await solve(sandbox, task)
        return await run_verifier(sandbox, task)
    finally:
        await sandbox.close()


@pytest.mark.parametrize("task", TOY_TASKS, ids=lambda t: f"{t.split}/{t.name}")
async def test_an_untouched_workspace_is_graded_below_one(
    backend: LocalSandboxBackend, task: HarborTask
) -> None:
    outcome = await verify(backend, task, solved=False)
    assert outcome.reward is not None and outcome.reward < 1.0, outcome
    assert not outcome.timed_out and outcome.exit_code == 0


@pytest.mark.parametrize("task", TOY_TASKS, ids=lambda t: f"{t.split}/{t.name}")
async def test_the_reference_solution_is_graded_one(backend: LocalSandboxBackend, task: HarborTask) -> None:
    outcome = await verify(backend, task, solved=True)
    assert outcome.reward == 1.0, outcome
    assert not outcome.timed_out and outcome.exit_code == 0


async def test_the_two_score_task_reports_both_scores_and_reward_key_picks_one(
    backend: LocalSandboxBackend,
) -> None:
    task = next(t for t in TOY_TASKS if t.name == "add-slugify")
    sandbox = await backend.start(task, lifetime_s=120)
    try:
        untouched = await run_verifier(sandbox, task, reward_key="cases_passed")
        await solve(sandbox, task)
        solved = await run_verifier(sandbox, task)
    finally:
        await sandbox.close()
    assert untouched.reward == 0.0 and untouched.rewards == {"reward": 0.0, "cases_passed": 0.0}
    assert solved.reward == 1.0 and solved.rewards == {"reward": 1.0, "cases_passed": 1.0}


@pytest.mark.parametrize(
    ("test_sh", "detail"),
    [
        ("sleep 30\n", "the verifier timed out after 0.5 s"),
        ("echo checked\n", "the verifier wrote no reward"),
        ("echo PASSED > /logs/verifier/reward.txt\n", "reward.txt does not hold one number: 'PASSED'"),
    ],
)
async def test_a_verifier_that_hangs_or_writes_no_number_leaves_the_rollout_ungraded(
    backend: LocalSandboxBackend, task_writer: TaskWriter, test_sh: str, detail: str
) -> None:
    task = load_task(task_writer("broken-verifier", test_sh=test_sh))
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        outcome = await run_verifier(sandbox, task, timeout_s=0.5 if "sleep" in test_sh else None)
    finally:
        await sandbox.close()
    assert outcome.reward is None and outcome.detail == detail
    assert outcome.timed_out == ("sleep" in test_sh)
