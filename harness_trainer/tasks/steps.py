"""Harbor's multi-step tasks: one environment, several instructions in order, each verified, one reward.

A task whose ``task.toml`` has ``[[steps]]`` tables is run as its steps, in order, in one sandbox: for each
step the agent is started again with the step's own instruction (a new agent process, so no context is
shared but what the agent left in the sandbox), then the step is verified. The folder::

    <task>/task.toml             multi_step_reward_strategy = "mean" | "final"; [[steps]] name = "...", ...
    <task>/environment/          built once, shared by every step
    <task>/tests/                optional: copied to /tests for every step's verifier, first
    <task>/steps/<name>/instruction.md   the step's instruction (required)
    <task>/steps/<name>/tests/           copied over the task's tests/ (a test.sh here or there is required)
    <task>/steps/<name>/workdir/         optional: copied into the working directory before the step's
                                         agent starts; its ``setup.sh`` is run there first, then removed
    <task>/steps/<name>/solution/solve.sh  optional reference solution (never run in rollouts)

A step's ``[steps.agent] timeout_sec`` and ``[steps.verifier] timeout_sec`` / ``env`` fall back to the
task's ``[agent]`` / ``[verifier]``. ``min_reward`` (a number, or a table of named scores) ends the
rollout after a step that scores below it: the later steps are not run and score 0.
``contributes_to_mean = false`` keeps a step (a setup step, say) out of the mean.

This module is the steps' data and the pure roll-up of their rewards (:func:`rolled_up`,
:func:`stops_after`); the loader parses them and the rollout server runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from harness_trainer.tasks.task import SeparateVerifier

RewardStrategy = Literal["mean", "final"]
REWARD_STRATEGIES: tuple[RewardStrategy, ...] = ("mean", "final")
SETUP_SCRIPT = "setup.sh"


@dataclass(frozen=True)
class TaskStep:
    """One ``[[steps]]`` entry with its folder ``steps/<name>``."""

    name: str
    path: Path
    instruction: str
    agent_timeout_sec: float
    verifier_timeout_sec: float
    verifier_env: dict[str, str] = field(default_factory=dict)
    min_reward: float | dict[str, float] | None = None
    contributes_to_mean: bool = True
    separate_verifier: SeparateVerifier | None = None
    """Set when the step is verified in a sandbox of its own: its ``[steps.verifier]`` mode, else the
    task's (Harbor lets a task mix shared and separate steps)."""

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def workdir_dir(self) -> Path:
        return self.path / "workdir"

    @property
    def solution(self) -> Path | None:
        candidate = self.path / "solution" / "solve.sh"
        return candidate if candidate.is_file() else None


def stops_after(step: TaskStep, reward: float | None, rewards: dict[str, float]) -> bool:
    """Whether the rollout ends after ``step``, which scored ``reward`` (named scores ``rewards``): it has
    a ``min_reward`` and missed it. A step without a reward misses any minimum; a named score it did not
    write counts as 0."""
    if step.min_reward is None:
        return False
    if reward is None:
        return True
    if isinstance(step.min_reward, dict):
        return any(rewards.get(key, 0.0) < least for key, least in step.min_reward.items())
    return reward < step.min_reward


def rolled_up(strategy: RewardStrategy, steps: Sequence[TaskStep], rewards: Sequence[float]) -> float:
    """The task's reward from the rewards of the steps that ran (``rewards[i]`` is ``steps[i]``'s; the
    steps after them did not run and score 0): ``mean`` over the steps that contribute to it, ``final``
    the last step's."""
    if len(rewards) > len(steps):
        raise ValueError(f"{len(rewards)} rewards for {len(steps)} steps")
    scores = [*rewards, *[0.0] * (len(steps) - len(rewards))]
    if strategy == "final":
        return scores[-1]
    counted = [score for step, score in zip(steps, scores, strict=True) if step.contributes_to_mean]
    return sum(counted) / len(counted) if counted else 0.0
