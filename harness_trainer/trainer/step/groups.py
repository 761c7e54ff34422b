"""A rollout group's records, as the scheduler fills them in and the step's data shaping reads them.

Plain data, kept apart from the threaded scheduler (:mod:`.scheduling`) so that the pure modules that read
finished groups (:mod:`.batch`, :mod:`.rollout_log`) import no threads or event loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome
from harness_trainer.trainer.step.rows import Row


@dataclass
class Rollout:
    """One member of a group, once its session is over."""

    group: int
    member: int
    policy_version: int = 0
    reward: float | None = None
    outcome: HarnessRolloutOutcome | None = None
    trace: TrainingTrace | None = None
    rows: list[Row] = field(default_factory=list)
    unscorable: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    verify_metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[Any] | None = None
    capture_session_id: str | None = None
    """The capture session the rollout's model calls went through, once its session reports it."""

    @property
    def scored(self) -> bool:
        return self.unscorable is None and self.reward is not None

    @property
    def rollout_id(self) -> str:
        """The episode id its factory was given (the capture session's metadata keeps it)."""
        return f"group{self.group}-member{self.member}"


@dataclass
class Group:
    """``num_generations`` rollouts of one dataset row with one seed."""

    index: int
    row: dict[str, Any]
    seed: int
    rollouts: list[Rollout]
    harness: str | None = None
    """The harness every member ran, when the factory mixes harnesses (else None: the run has one)."""

    @property
    def scored(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.scored]
