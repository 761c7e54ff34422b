"""Harbor tasks: load task folders, serve them by split and index, and turn a verifier's output into a reward.

Public names: :class:`HarborTask`, :class:`EnvironmentSpec`, :class:`TaskError`, :func:`load_task`; the
sources :class:`TaskSource` (protocol), :class:`LocalTaskSource`, :class:`HubTaskSource`,
:func:`open_task_source`; rewards :func:`parse_reward`, :class:`RewardResult`, :func:`run_verifier`,
:class:`VerifierOutcome`.
"""

from __future__ import annotations

from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.reward import RewardResult, VerifierOutcome, parse_reward, run_verifier
from harness_trainer.tasks.sources import HubTaskSource, LocalTaskSource, TaskSource, open_task_source
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask, TaskError

__all__ = [
    "EnvironmentSpec",
    "HarborTask",
    "HubTaskSource",
    "LocalTaskSource",
    "RewardResult",
    "TaskError",
    "TaskSource",
    "VerifierOutcome",
    "load_task",
    "open_task_source",
    "parse_reward",
    "run_verifier",
]
