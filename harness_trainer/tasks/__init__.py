"""Harbor tasks, as pure data: load task folders, address them by split and index, and turn what a
verifier wrote into a reward (running the verifier is the rollout's:
:mod:`harness_trainer.rollouts.server.verifier`).

Public names: :class:`HarborTask`, :class:`EnvironmentSpec`, :class:`TaskError`, :func:`load_task`; the
sources :class:`TaskSource` (protocol), :class:`LocalTaskSource`, :class:`HubTaskSource`,
:func:`open_task_source`, :class:`TaskCatalog`; rewards :func:`parse_reward`, :class:`RewardResult`.
"""

from __future__ import annotations

from harness_trainer.tasks.catalog import TaskCatalog
from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.reward import RewardResult, parse_reward
from harness_trainer.tasks.sources import HubTaskSource, LocalTaskSource, TaskSource, open_task_source
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask, TaskError

__all__ = [
    "EnvironmentSpec",
    "HarborTask",
    "HubTaskSource",
    "LocalTaskSource",
    "RewardResult",
    "TaskCatalog",
    "TaskError",
    "TaskSource",
    "load_task",
    "open_task_source",
    "parse_reward",
]
