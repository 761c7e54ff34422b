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

import posixpath
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harness_trainer.tasks.compose import ComposeSpec
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


ARTIFACTS_DIR = "/logs/artifacts"
"""Always copied from the agent's sandbox to a separate verifier's (Harbor's rule), besides ``artifacts``."""


@dataclass(frozen=True)
class SeparateVerifier:
    """``[verifier] environment_mode = "separate"`` (or a ``[verifier.environment]``): the verifier runs in
    a sandbox of its own, which sees of the agent's work only the artifacts copied over."""

    environment: EnvironmentSpec
    """``[verifier.environment]``; without one, the task's ``[environment]``."""
    artifacts: tuple[str, ...]
    """Absolute paths copied from the agent's sandbox (those that exist): :data:`ARTIFACTS_DIR` and the
    task's top-level ``artifacts``."""
    image_folder: str | None
    """The task's folder whose Dockerfile defines the verifier's image (``tests``, or a step's
    ``steps/<name>/tests``): its build context, and the image holds ``/tests`` itself (Harbor uploads
    nothing). None: the verifier's sandbox is a fresh one of the task's own environment, with the tests
    copied in."""

    @property
    def from_tests(self) -> bool:
        return self.image_folder is not None


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
    separate_verifier: SeparateVerifier | None = None
    """Set when the verifier runs in a sandbox of its own; None: in the agent's, after it."""
    environment_folder: str = "environment"
    """The folder of the task holding its Dockerfile and build context (``tests`` for a verifier's)."""
    compose: ComposeSpec | None = None
    """The environment's ``docker-compose.yaml``: the agent runs in its ``main`` service (this task's
    image), its sidecars beside it (:mod:`.compose`)."""
    artifact_dirs: tuple[str, ...] = ()
    """Folders a separate verifier's sandbox gets the agent's artifacts in: a sandbox that shares this
    machine's filesystem (the local one) keeps them private."""

    @property
    def dockerfile(self) -> Path | None:
        candidate = self.environment_dir / "Dockerfile"
        return candidate if candidate.is_file() else None

    @property
    def environment_dir(self) -> Path:
        return self.path / self.environment_folder

    def verifier_task(self, step: TaskStep | None = None) -> HarborTask:
        """The task as its (or ``step``'s) separate verifier's sandbox starts it: its own environment (a
        tests folder's Dockerfile, or a fresh copy of the task's), under its own name (images and templates
        are per name and content).

        Raises:
            ValueError: that verifier is not separate.
        """
        separate = self.separate_verifier if step is None else step.separate_verifier
        if separate is None:
            raise ValueError(f"{self.name}: its verifier runs in the agent's sandbox, not one of its own")
        folder = separate.image_folder or self.environment_folder
        folders = {posixpath.dirname(path.rstrip("/")) or "/" for path in separate.artifacts}
        name = f"{self.name}-verifier" if step is None else f"{self.name}-{step.name}-verifier"
        return replace(
            self, name=name, environment=separate.environment, steps=(),
            environment_folder=folder, separate_verifier=None, artifact_dirs=tuple(sorted(folders - {"/"})),
            compose=self.compose if folder == self.environment_folder else None,
        )  # fmt: skip

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
