"""The toy-skills family: generated the same from a seed, held out for real, committed as generated, and
every task graded for real in a local sandbox (its solution 1; untouched or the warm-up's distractor 0)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from harness_trainer.devloop.solver import DISTRACTOR, solve_command
from harness_trainer.rollouts.server.verifier import run_verifier
from harness_trainer.sandboxes import LocalSandboxBackend
from harness_trainer.sandboxes.rootless import unavailable
from harness_trainer.tasks import HarborTask, LocalTaskSource
from harness_trainer.tasks.toy_family import SKILLS, SOLUTIONS, VALUES, WORDINGS, toy_family, write_family

from .conftest import TOY_SKILLS

FAMILY = toy_family()
COMMITTED = LocalTaskSource(TOY_SKILLS)
COMMITTED_TASKS = [task for split in COMMITTED.splits() for task in COMMITTED.tasks(split)]


def test_the_same_seed_gives_the_same_family_and_another_seed_another() -> None:
    assert toy_family(0) == FAMILY
    assert toy_family(1) != FAMILY
    assert {split: len(tasks) for split, tasks in FAMILY.items()} == {"train": 32, "test": 16}
    small = toy_family(3, {"train": 2, "test": 1})
    assert [len(small["train"]), len(small["test"])] == [2 * len(SKILLS), len(SKILLS)]


def test_no_test_instance_or_instruction_occurs_in_train() -> None:
    train, test = FAMILY["train"], FAMILY["test"]
    assert not {(t.skill, t.value, t.wording) for t in train} & {(t.skill, t.value, t.wording) for t in test}
    instructions = [t.instruction for t in train + test]
    assert len(set(instructions)) == len(instructions)
    folders = [t.folder for t in train + test]
    assert len(set(folders)) == len(folders)


def test_a_test_instance_pairs_a_value_and_a_wording_train_has_for_its_skill_with_others() -> None:
    train = FAMILY["train"]
    for task in FAMILY["test"]:
        assert any(t.skill == task.skill and t.value == task.value for t in train), task
        assert any(t.skill == task.skill and t.wording == task.wording for t in train), task
    for skill in SKILLS:
        assert {t.value for t in train if t.skill == skill} == set(VALUES[skill])
        assert {t.wording for t in train if t.skill == skill} == set(range(len(WORDINGS[skill])))
        held_out = [t.value for t in FAMILY["test"] if t.skill == skill]
        assert len(set(held_out)) == len(held_out) == 4


def test_asking_for_more_instances_than_a_skill_has_is_refused() -> None:
    with pytest.raises(ValueError, match="too few instances"):
        toy_family(0, {"train": 9, "test": 4})
    with pytest.raises(ValueError, match="too few instances"):
        toy_family(0, {"train": 2, "test": 5})


def test_the_committed_family_is_the_generator_output(tmp_path: Path) -> None:
    write_family(tmp_path)

    def tree(root: Path) -> dict[str, tuple[str, bool]]:
        return {
            str(path.relative_to(root)): (path.read_text(), bool(path.stat().st_mode & stat.S_IXUSR))
            for path in sorted(root.rglob("*"))
            if path.is_file()
        }

    assert tree(TOY_SKILLS) == tree(tmp_path), (
        "harness_trainer/examples/toy-skills is stale: "
        "python -m harness_trainer.tasks.toy_family harness_trainer/examples/toy-skills"
    )


def test_every_committed_task_loads_and_its_solution_is_its_skills_one_command() -> None:
    assert COMMITTED.splits() == ["test", "train"]
    for split, tasks in FAMILY.items():
        for generated, loaded in zip(tasks, COMMITTED.tasks(split), strict=True):
            assert loaded.name == generated.folder and loaded.instruction == generated.instruction
            assert loaded.config["metadata"]["skill"] == generated.skill
            assert solve_command(loaded) == SOLUTIONS[generated.skill].format(value=generated.value)


@pytest.mark.skipif(unavailable() is not None, reason=f"no local sandbox here: {unavailable()}")
@pytest.mark.parametrize("task", COMMITTED_TASKS, ids=lambda t: f"{t.split}/{t.name}")
async def test_only_the_solution_solves_a_family_task_untouched_or_after_the_distractor_it_is_zero(
    backend: LocalSandboxBackend, task: HarborTask
) -> None:
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        untouched = await run_verifier(sandbox, task)
        await sandbox.exec(DISTRACTOR, timeout_s=30)
        after_distractor = await run_verifier(sandbox, task)
        solved = await sandbox.exec(solve_command(task), timeout_s=30)
        assert solved.exit_code == 0, solved.stdout + solved.stderr
        after_solution = await run_verifier(sandbox, task)
    finally:
        await sandbox.close()
    assert (untouched.reward, after_distractor.reward, after_solution.reward) == (0.0, 0.0, 1.0)
