"""A Harbor task, as loaded from its folder (the format of the ``harbor`` package, read without it).

Folder layout::

    <task>/task.toml            [task] [metadata] [agent] [verifier] [environment] ... (schema 1.x)
    <task>/instruction.md       what the agent is told
    <task>/environment/         Dockerfile (+ files it COPYs)
    <task>/tests/test.sh        the verifier: writes /logs/verifier/reward.txt or reward.json
    <task>/solution/solve.sh    optional reference solution
    <task>/steps/<name>/        a multi-step task's steps (``[[steps]]``; :mod:`.steps`): then the task's
                                instruction.md and tests/ are optional

:func:`harness_trainer.tasks.loader.load_task` builds a :class:`HarborTask` from a folder and raises
:class:`TaskError` for anything it cannot use; a loaded task is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness_trainer.tasks.steps import RewardStrategy, TaskStep


class TaskError(ValueError):
    """A task folder that cannot be used (missing instruction, broken toml, …); says which and why."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """``[environment]`` of task.toml; unknown keys are kept in ``extra``."""

    docker_image: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    allow_internet: bool = True
    build_timeout_sec: float | None = None
    workdir: str | None = None
    """The agent's working directory (absolute); None: the image's ``WORKDIR``, else ``/app``."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HarborTask:
    """One task. Paths are absolute; ``config`` is the whole parsed task.toml (unknown keys kept)."""

    name: str
    path: Path
    instruction: str
    """What the agent is told; a multi-step task's own instruction.md (never sent: each step's is), else
    its first step's, so that lists and look-ups by instruction still work."""
    config: dict[str, Any]
    agent_timeout_sec: float
    verifier_timeout_sec: float
    environment: EnvironmentSpec
    split: str = ""
    index: int = 0
    verifier_env: dict[str, str] = field(default_factory=dict)  # ``[verifier] env``, given to test.sh
    steps: tuple[TaskStep, ...] = ()
    """A multi-step task's steps, in order (:mod:`.steps`); empty for a task of one instruction."""
    reward_strategy: RewardStrategy = "mean"
    """How a multi-step task's step rewards make its reward (``multi_step_reward_strategy``)."""

    @property
    def dockerfile(self) -> Path | None:
        candidate = self.path / "environment" / "Dockerfile"
        return candidate if candidate.is_file() else None

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution(self) -> Path | None:
        candidate = self.path / "solution" / "solve.sh"
        return candidate if candidate.is_file() else None


def bare_task(name: str, folder: Path) -> HarborTask:
    """A task with no instruction, files or environment: for starting a plain sandbox (smoke checks)."""
    return HarborTask(
        name=name, path=folder, instruction="", config={}, agent_timeout_sec=60, verifier_timeout_sec=60,
        environment=EnvironmentSpec(),
    )  # fmt: skip
