"""The toy-skills family: generated the same from a seed, held out for real (new values, new combinations of
skills, no solution, verifier or expected outcome shared with training), committed as generated, and every
task graded for real in a local sandbox (its solution 1; untouched or the warm-up's distractor 0)."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from harness_trainer.devloop.instances import plan_recordings
from harness_trainer.devloop.solver import DISTRACTOR, solve_command
from harness_trainer.rollouts.server.verifier import run_verifier
from harness_trainer.sandboxes import LocalSandboxBackend
from harness_trainer.sandboxes.rootless import unavailable
from harness_trainer.tasks import HarborTask, LocalTaskSource
from harness_trainer.tasks.held_out import check_held_out, task_values
from harness_trainer.tasks.toy_family import SKILLS, VALUES, WORDINGS, ToyTask, toy_family, write_family

from .conftest import TOY_SKILLS

FAMILY = toy_family()
COMMITTED = LocalTaskSource(TOY_SKILLS)
TEMPLATES = plan_recordings(COMMITTED.tasks("train"))
# Graded for real: every test task and one train task per skill and wording. The other train tasks are those
# but for their number (plan_recordings groups tasks by their files with the number blanked out).
GRADED = COMMITTED.tasks("test") + [
    task for task in COMMITTED.tasks("train") if task.name in {t.recorded for t in TEMPLATES}
]


def test_the_same_seed_gives_the_same_family_and_another_seed_another() -> None:
    assert toy_family(0) == FAMILY
    assert toy_family(1) != FAMILY
    assert {split: len(tasks) for split, tasks in FAMILY.items()} == {"train": 800, "test": 16}
    small = toy_family(3, {"train": 2, "test": 1}, combined=1)
    assert [len(small["train"]), len(small["test"])] == [2 * len(SKILLS), len(SKILLS) + 1]


def test_every_value_is_its_task_s_own_and_no_test_value_occurs_in_train() -> None:
    train, test = FAMILY["train"], FAMILY["test"]
    train_values = [v for t in train for v in t.values]
    test_values = [v for t in test for v in t.values]
    assert len(set(train_values)) == len(train_values) == 800
    assert len(set(test_values)) == len(test_values) == 20
    assert not set(train_values) & set(test_values)
    assert set(train_values) | set(test_values) <= set(VALUES)
    for seed in range(5):  # every seed's cut, not only the shipped one
        family = toy_family(seed)
        assert not {v for t in family["train"] for v in t.values} & {
            v for t in family["test"] for v in t.values
        }


def test_no_test_solution_verifier_expected_outcome_or_instruction_equals_a_training_one() -> None:
    train, test = FAMILY["train"], FAMILY["test"]
    for piece in ("solution", "instruction", "expected"):
        assert not {getattr(t, piece) for t in train} & {getattr(t, piece) for t in test}, piece
    verifiers = [t.files()["tests/test.sh"] for t in train + test]
    assert len(set(verifiers)) == len(verifiers)
    folders = [t.folder for t in train + test]
    assert len(set(folders)) == len(folders)


def test_two_step_test_tasks_combine_skills_that_train_holds_only_alone() -> None:
    train, test = FAMILY["train"], FAMILY["test"]
    assert all(len(t.skills) == 1 for t in train)
    combined = [t for t in test if len(t.skills) == 2]
    assert len(combined) == 4 and len({t.skills for t in combined}) == 4
    for task in combined:
        first, second = task.skills
        assert first != second and {first, second} <= {t.skills[0] for t in train}
        one_step = [ToyTask("test", (skill,), (value,), task.wording) for skill, value in task.parts]
        assert task.instruction == " ".join(t.instruction.strip() for t in one_step) + "\n"
        assert task.solution == " && ".join(t.solution for t in one_step)
        assert task.expected == tuple(t.expected[0] for t in one_step)
    for split in ("train", "test"):  # every wording of every skill in both splits
        for skill in SKILLS:
            wordings = {t.wording for t in FAMILY[split] if t.skills == (skill,)}
            assert wordings == set(range(len(WORDINGS[skill]))), (split, skill)


def test_asking_for_more_values_or_pairs_than_there_are_is_refused() -> None:
    with pytest.raises(ValueError, match="too few values or pairs"):
        toy_family(0, {"train": 220, "test": 3})
    with pytest.raises(ValueError, match="too few values or pairs"):
        toy_family(0, {"train": 2, "test": 1}, combined=7)


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


def test_the_shipped_test_split_is_held_out_from_train() -> None:
    """The issue's property on the committed tasks: no test task's solution, verifier or expected output
    equals a training task's, and every test value is absent from the training split."""
    check_held_out(TOY_SKILLS)
    train, test = COMMITTED.tasks("train"), COMMITTED.tasks("test")
    train_values = {v for task in train for v in task_values(task)}
    assert all(task_values(task) for task in train + test)
    assert not {v for task in test for v in task_values(task)} & train_values
    # Nor anywhere in a training task's files, as a number of its own: not in a directory, a file name,
    # a word or an extension.
    train_text = "\n".join(
        path.read_text() for task in train for path in task.path.rglob("*") if path.is_file()
    )
    for task in test:
        for value in task_values(task):
            assert not re.search(rf"(?<![0-9]){value}(?![0-9])", train_text), (task.name, value)


def test_the_train_split_is_one_task_per_skill_and_wording_and_the_others_but_for_their_number() -> None:
    assert len(TEMPLATES) == sum(len(w) for w in WORDINGS.values())
    assert sorted(len(t.members) for t in TEMPLATES) == [100] * len(TEMPLATES)


def test_every_committed_task_loads_and_its_solution_is_its_one_command_line() -> None:
    assert COMMITTED.splits() == ["test", "train"]
    for split, tasks in FAMILY.items():
        for generated, loaded in zip(tasks, COMMITTED.tasks(split), strict=True):
            assert loaded.name == generated.folder and loaded.instruction == generated.instruction
            assert tuple(loaded.config["metadata"]["skills"]) == generated.skills
            assert task_values(loaded) == generated.values
            assert solve_command(loaded) == generated.solution


@pytest.mark.skipif(unavailable() is not None, reason=f"no local sandbox here: {unavailable()}")
@pytest.mark.parametrize("task", GRADED, ids=lambda t: f"{t.split}/{t.name}")
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


@pytest.mark.skipif(unavailable() is not None, reason=f"no local sandbox here: {unavailable()}")
@pytest.mark.parametrize(
    "task",
    [t for t in COMMITTED.tasks("test") if len(t.config["metadata"]["skills"]) == 2],
    ids=lambda t: t.name,
)
async def test_a_two_step_task_is_not_solved_by_either_step_alone(
    backend: LocalSandboxBackend, task: HarborTask
) -> None:
    for step in solve_command(task).split(" && "):
        sandbox = await backend.start(task, lifetime_s=60)
        try:
            done = await sandbox.exec(step, timeout_s=30)
            assert done.exit_code == 0, done.stdout + done.stderr
            assert (await run_verifier(sandbox, task)).reward == 0.0, step
        finally:
            await sandbox.close()
