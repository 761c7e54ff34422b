"""Multi-step tasks as loaded (``[[steps]]`` and ``steps/<name>/``) and their rewards' roll-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.steps import TaskStep, rolled_up, stops_after
from harness_trainer.tasks.task import TaskError
from tests.tasks.conftest import PASSING_TEST_SH, TaskWriter

TWO_STEPS = """version = "2.0"
multi_step_reward_strategy = "final"
[agent]
timeout_sec = 100.0
[verifier]
timeout_sec = 20.0
env = { MODE = "strict", LEVEL = "1" }

[[steps]]
name = "01-scaffold"
min_reward = 1.0
contributes_to_mean = false
[steps.agent]
timeout_sec = 30.0

[[steps]]
name = "02-implement"
min_reward = { tests = 0.5 }
[steps.verifier]
timeout_sec = 40.0
env = { LEVEL = "2" }
"""


def add_step(folder: Path, name: str, instruction: str | None = "Do step.\n", test_sh: bool = True) -> Path:
    step = folder / "steps" / name
    (step / "tests").mkdir(parents=True)
    if instruction is not None:
        (step / "instruction.md").write_text(instruction)
    if test_sh:
        (step / "tests" / "test.sh").write_text(PASSING_TEST_SH)
    return step


def test_steps_load_in_order_with_their_own_settings_falling_back_to_the_tasks(
    task_writer: TaskWriter,
) -> None:
    folder = task_writer("t", toml=TWO_STEPS, instruction=None, test_sh=None)
    add_step(folder, "01-scaffold", "Scaffold the package.\n")
    add_step(folder, "02-implement", "Implement it.\n")
    task = load_task(folder)
    assert task.reward_strategy == "final"
    assert [s.name for s in task.steps] == ["01-scaffold", "02-implement"]
    first, second = task.steps
    assert task.instruction == first.instruction == "Scaffold the package.\n"  # no task-level instruction.md
    assert (first.agent_timeout_sec, first.verifier_timeout_sec) == (30.0, 20.0)
    assert (second.agent_timeout_sec, second.verifier_timeout_sec) == (100.0, 40.0)
    assert first.verifier_env == {"MODE": "strict", "LEVEL": "1"}
    assert second.verifier_env == {"MODE": "strict", "LEVEL": "2"}
    assert (first.min_reward, second.min_reward) == (1.0, {"tests": 0.5})
    assert (first.contributes_to_mean, second.contributes_to_mean) == (False, True)
    assert first.tests_dir == folder / "steps" / "01-scaffold" / "tests"


def test_a_task_with_its_own_instruction_keeps_it_and_a_step_may_use_the_tasks_test_sh(
    task_writer: TaskWriter,
) -> None:
    folder = task_writer("t", toml='[[steps]]\nname = "only"\n', instruction="The whole story.\n")
    add_step(folder, "only", test_sh=False)
    task = load_task(folder)
    assert task.instruction == "The whole story.\n" and task.reward_strategy == "mean"


@pytest.mark.parametrize(
    ("toml", "steps", "message"),
    [
        ('[[steps]]\nname = "../up"\n', {}, "name: expected a folder name"),
        ('[[steps]]\nname = "a"\n[[steps]]\nname = "a"\n', {"a": True}, "name of an earlier step too"),
        ('[[steps]]\nname = "a"\n', {}, "instruction.md: missing"),
        ('[[steps]]\nname = "a"\n', {"a": False}, "test.sh: missing, and the task has no tests/test.sh"),
        ('[[steps]]\nname = "a"\nmin_reward = "high"\n', {"a": True}, "min_reward: expected a number"),
        ('[[steps]]\nname = "a"\ncontributes_to_mean = false\n', {"a": True}, "every step has contributes"),
        ('multi_step_reward_strategy = "max"\n[[steps]]\nname = "a"\n', {"a": True}, "expected one of mean"),
        ('[[steps]]\nname = "a"\n[steps.agent]\ntimeout_sec = -1\n', {"a": True}, "[steps.agent] timeout"),
    ],
)
def test_a_malformed_step_is_refused_naming_it(
    task_writer: TaskWriter, toml: str, steps: dict[str, bool], message: str
) -> None:
    folder = task_writer("t", toml=toml, instruction=None, test_sh=None)
    for name, with_tests in steps.items():
        if not (folder / "steps" / name).exists():
            add_step(folder, name, test_sh=with_tests)
    with pytest.raises(TaskError) as refused:
        load_task(folder)
    assert message in str(refused.value)


def step(name: str, min_reward: float | dict[str, float] | None = None, mean: bool = True) -> TaskStep:
    return TaskStep(name, Path(name), "x", 1.0, 1.0, min_reward=min_reward, contributes_to_mean=mean)


def test_a_step_below_its_minimum_ends_the_rollout() -> None:
    assert not stops_after(step("a"), 0.0, {})
    assert stops_after(step("a", 1.0), 0.5, {}) and not stops_after(step("a", 1.0), 1.0, {})
    assert stops_after(step("a", 0.0), None, {})  # no reward misses any minimum
    keyed = step("a", {"tests": 0.5, "style": 0.2})
    assert not stops_after(keyed, 0.1, {"tests": 0.5, "style": 0.3})
    assert stops_after(keyed, 0.9, {"tests": 0.9})  # a score it did not write counts as 0


def test_the_roll_up_counts_steps_not_run_as_zero_and_leaves_out_what_does_not_contribute() -> None:
    steps = [step("setup", mean=False), step("a"), step("b")]
    assert rolled_up("mean", steps, [0.0, 1.0, 0.5]) == 0.75
    assert rolled_up("mean", steps, [1.0, 1.0]) == 0.5  # "b" did not run
    assert rolled_up("final", steps, [1.0, 1.0, 0.25]) == 0.25
    assert rolled_up("final", steps, [1.0, 1.0]) == 0.0
    with pytest.raises(ValueError, match="4 rewards for 3 steps"):
        rolled_up("mean", steps, [1.0] * 4)


def test_a_steps_verifier_takes_the_tasks_mode_unless_it_has_its_own(task_writer: TaskWriter) -> None:
    toml = """artifacts = ["/app/out.txt"]
[verifier]
environment_mode = "separate"
[verifier.environment]
memory_mb = 512

[[steps]]
name = "inherits"
artifacts = ["/app/more.txt"]

[[steps]]
name = "own-image"

[[steps]]
name = "shared"
[steps.verifier]
environment_mode = "shared"
"""
    folder = task_writer("t", toml=toml, instruction=None, test_sh=None)
    for name in ("inherits", "own-image", "shared"):
        add_step(folder, name)
    (folder / "steps" / "own-image" / "tests" / "Dockerfile").write_text("FROM python:3.12-slim\n")
    inherits, own_image, shared = load_task(folder).steps
    assert inherits.separate_verifier is not None and own_image.separate_verifier is not None
    assert inherits.separate_verifier.artifacts == ("/logs/artifacts", "/app/out.txt", "/app/more.txt")
    assert inherits.separate_verifier.environment.memory_mb == 512  # the task's [verifier.environment]
    assert inherits.separate_verifier.image_folder is None  # no Dockerfile: a fresh sandbox, tests copied in
    assert own_image.separate_verifier.image_folder == "steps/own-image/tests"
    assert shared.separate_verifier is None
    verifier = load_task(folder).verifier_task(own_image)
    assert (
        verifier.name == "t-own-image-verifier" and verifier.dockerfile == own_image.tests_dir / "Dockerfile"
    )


def test_a_step_verifier_mode_harbor_refuses_is_refused(task_writer: TaskWriter) -> None:
    toml = '[[steps]]\nname = "a"\n[steps.verifier]\nenvironment_mode = "shared"\n'
    toml += "[steps.verifier.environment]\ncpus = 1\n"
    folder = task_writer("t", toml=toml, instruction=None, test_sh=None)
    add_step(folder, "a")
    with pytest.raises(TaskError, match=r'\[steps.verifier\]: environment_mode = "shared" with a'):
        load_task(folder)
